"""CO (colocated) mode — the heart of the paper (DESIGN §5).

Every host runs this same loop as its own Python process (multi-controller). Per step, host h:
  1. takes its shard of the step's prompts (deterministic from seed, step, h);
  2. samples G completions per prompt on its local devices (no cross-host traffic);
  3. scores rewards on its CPU threads;
  4. normalises advantages per group (every group lives on one host);
  5. contributes its rows to the global batch (`jax.make_array_from_process_local_data`) for one
     jitted SPMD train step on the global mesh, whose gradient all-reduce is the only collective;
  6. reports metrics (gathered so host 0 writes per-host and aggregate records) and checkpoints.
With an eval block, steps it names start with a held-out evaluation (locojax.evaluate), outside the
step's timers: each host evaluates its shard, and the counts travel in the step's metrics gather;
one more evaluation follows the last step, recorded at step = steps.
With one process there is no `jax.distributed` at all; the same code runs on the local devices.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from locojax import metrics as m
from locojax.evaluate import Evaluator, eval_rewards, evaluation_due
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
from locojax.modes.run_files import (
    HostStatus,
    RunResult,
    cancel_requested,
    finish,
    make_logger,
    start_output,
)
from locojax.rollout import rollout_key
from locojax.spec import RunSpec
from locojax.tasks import host_slice
from locojax.train import make_logprobs_fn

CANCEL_KEY = "control/cancel"
CHECKSUM_KEY = "params/checksum"


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

    evaluator = None
    if spec.eval is not None:
        first, shard = host_slice(trainer.held_out, host, num_hosts)
        evaluator = Evaluator(spec, spec.eval, trainer.policy, shard, eval_rewards(spec.eval, trainer.task), first,
                              jax.local_devices())

    logger = make_logger(spec, out, host, trainer.start_step, console, extra_sinks)
    timer = m.PhaseTimer()
    where = HostStatus(out, host)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
    status, steps_done, combined = "succeeded", trainer.start_step, {}
    try:
        for step in range(trainer.start_step, spec.steps):
            evaluation = {}
            if evaluator is not None and evaluation_due(spec.eval, step):
                where(step, "eval")
                evaluation = evaluator.timed(trainer.state.params)
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
                record.update(evaluation)  # every host evaluates at the same steps: the names agree
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
        if evaluator is not None and status == "succeeded":
            where(spec.steps, "eval")
            evaluated = m.gather_host_metrics(evaluator.timed(trainer.state.params))
            final = logger.log_hosts(spec.steps, evaluated) if host == 0 else m.aggregate_hosts(evaluated)
            combined = {**combined, **final}
        trainer.checkpoints.wait_until_finished()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        logger.close()
        trainer.checkpoints.close()
    return finish(out, host, RunResult(status, steps_done, trainer.checkpoints.latest_step(), combined))
