"""CO (colocated) mode — the heart of the paper (DESIGN §5).

Every host runs this same loop as its own Python process (multi-controller). Per step, host h:
  1. takes its shard of the step's prompts (deterministic from seed, step, h);
  2. samples G completions per prompt on its local devices (no cross-host traffic);
  3. scores rewards on its CPU threads;
  4. normalises advantages per group (every group lives on one host);
  5. contributes its rows to the global batch (`jax.make_array_from_process_local_data`) for one
     jitted SPMD train step on the global mesh, whose gradient all-reduce is the only collective;
  6. reports metrics (gathered so host 0 writes per-host and aggregate records) and checkpoints.
With one process there is no `jax.distributed` at all; the same code runs on the local devices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from locojax import metrics as m
from locojax.modes.common import (
    HostRollout,
    RolloutRunner,
    params_checksum,
    prepare_trainer,
    prompts_for,
    score_and_normalise,
    to_local,
    train_temperature,
)
from locojax.rollout import rollout_key
from locojax.spec import RunSpec, dump_spec
from locojax.train import make_logprobs_fn

CANCEL_KEY = "control/cancel"
CHECKSUM_KEY = "params/checksum"


@dataclasses.dataclass
class RunResult:
    status: str  # "succeeded" | "cancelled"
    steps_done: int
    last_checkpoint_step: int | None
    final_metrics: dict[str, float]


def output_dir(spec: RunSpec) -> Path:
    return Path(spec.output_dir or Path("runs") / spec.name)


def start_output(spec: RunSpec, host: int) -> Path:
    out = output_dir(spec)
    if host == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.yaml").write_text(dump_spec(spec), encoding="utf-8")
    return out


def make_logger(spec: RunSpec, out: Path, host: int, start_step: int, console: bool,
                extra_sinks: Sequence[m.MetricSink]) -> m.MetricsLogger:
    """Host 0 writes the run's records (per host and aggregate) to metrics.jsonl and the console."""
    sinks = list(extra_sinks)
    if host == 0:
        sinks = [m.JsonlSink(out / "metrics.jsonl")] + sinks
        if console:
            sinks.append(m.ConsoleSink(spec.steps, description=spec.name, start_step=start_step))
    return m.MetricsLogger(sinks)


class HostStatus:
    """Where this host is (step, phase), in `<output_dir>/hosts/host<i>.json`, so that when a host
    dies the launcher or worker can say in which phase it was lost."""

    def __init__(self, out: Path, host: int):
        self.host = host
        self.path = out / "hosts" / f"host{host}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, step: int, phase: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": self.host, "step": step, "phase": phase, "pid": os.getpid()}))
        tmp.replace(self.path)  # atomic: a reader never sees half a file


def read_host_status(out: Path, host: int) -> dict | None:
    try:
        return json.loads((out / "hosts" / f"host{host}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def cancel_requested(cancel_file: str | Path | None) -> bool:
    return cancel_file is not None and Path(cancel_file).exists()


def finish(out: Path, host: int, result: RunResult) -> RunResult:
    if host == 0:
        (out / "result.json").write_text(json.dumps(dataclasses.asdict(result), indent=2), encoding="utf-8")
    return result


def run_co(
    spec: RunSpec,
    *,
    resume: bool = False,
    console: bool = True,
    cancel_file: str | Path | None = None,
    extra_sinks: Sequence[m.MetricSink] = (),
) -> RunResult:
    """Run (or resume) a CO run on this process's share of the hosts. Every process calls this."""
    num_hosts, host = jax.process_count(), jax.process_index()
    if spec.rollout.prompts_per_step % num_hosts:
        raise ValueError(f"rollout.prompts_per_step ({spec.rollout.prompts_per_step}) is not divisible by the "
                         f"{num_hosts} hosts of this job")
    out = start_output(spec, host)
    trainer = prepare_trainer(spec, jax.devices(), out / "checkpoints", resume)
    prompts_per_host = spec.rollout.prompts_per_step // num_hosts
    rows_per_host = prompts_per_host * spec.rollout.group_size
    runner = RolloutRunner(spec, trainer.policy, prompts_per_host, jax.local_devices())
    use_kl = spec.algo.kl_coef > 0
    if use_kl:  # the frozen reference is the starting policy (not a restored one), kept host-locally
        reference_params = to_local(trainer.reference_params, runner.replicated)
        reference_logprobs = make_logprobs_fn(trainer.policy.graphdef, train_temperature(spec))

    logger = make_logger(spec, out, host, trainer.start_step, console, extra_sinks)
    timer = m.PhaseTimer()
    where = HostStatus(out, host)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
    status, steps_done, combined = "succeeded", trainer.start_step, {}
    try:
        for step in range(trainer.start_step, spec.steps):
            with timer.step():
                where(step, "rollout")
                with timer.phase(m.TIME_ROLLOUT):
                    examples = prompts_for(trainer.task, spec, step, host, num_hosts)
                    with timer.device() as span:
                        local_params = to_local(trainer.state.params, runner.replicated)
                        tokens, mask, result = runner.sample(
                            local_params, examples, rollout_key(spec.seed, step), host * rows_per_host)
                        span.ready(result)
                    completions = runner.completions(result)
                rollout_s = timer.last_phase(m.TIME_ROLLOUT)
                where(step, "reward")
                rewards, per_fn, advantages = score_and_normalise(
                    spec, trainer.task, examples, completions, pool, timer)
                piece = HostRollout(examples, tokens, mask, result, completions, rewards, per_fn, advantages)
                rows = piece.batch()
                where(step, "train")
                if use_kl:
                    with timer.device(m.TIME_TRAIN) as span:
                        rows["ref_logprobs"] = np.asarray(span.ready(reference_logprobs(
                            reference_params, rows["tokens"], rows["prompt_mask"], rows["completion_mask"])))
                with timer.device(m.TIME_TRAIN) as span:
                    trainer.state, train_metrics = trainer.train_step(trainer.state, trainer.global_batch(rows))
                    span.ready(trainer.state)
                where(step, "checkpoint")
                with timer.phase(m.TIME_CHECKPOINT):
                    trainer.checkpoint(spec, force=step + 1 == spec.steps)
                where(step, "metrics")
                record = {**piece.metrics(spec.rollout.group_size, rollout_s, trainer.policy.tokenizer.eos_id),
                          **jax.device_get(train_metrics)}
                record[CHECKSUM_KEY] = params_checksum(trainer.state.params)
                record[CANCEL_KEY] = float(cancel_requested(cancel_file))
                with timer.network():
                    # Host 0 needs every host's record; the gather doubles as the agreement on
                    # cancellation, so all hosts stop after the same step.
                    gathered = m.gather_host_metrics({k: float(v) for k, v in record.items()})
            times = timer.metrics()
            all_times = m.gather_host_metrics(times) if num_hosts > 1 else [times]
            train_tokens = int(rows["prompt_mask"].sum() + rows["completion_mask"].sum())
            for row, host_times in zip(gathered, all_times):
                row.update(host_times)
                row[m.THROUGHPUT_TRAIN_TOKENS] = m.throughput(train_tokens, row.get(m.TIME_TRAIN, 0.0))
            cancel = any(row.pop(CANCEL_KEY, 0.0) for row in gathered)
            combined = logger.log_hosts(step, gathered) if host == 0 else m.aggregate_hosts(gathered)
            steps_done = step + 1
            if cancel:
                status = "cancelled"
                trainer.checkpoint(spec, force=True)
                break
        trainer.checkpoints.wait_until_finished()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        logger.close()
        trainer.checkpoints.close()
    return finish(out, host, RunResult(status, steps_done, trainer.checkpoints.latest_step(), combined))
