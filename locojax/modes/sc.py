"""SC (single controller): the Pathways-style baseline, kept for honest side-by-side comparison.

One controller process owns every device of every simulated host (hosts x devices_per_host CPU
devices in one process). Per step it:
  1. dispatches each host's rollout on that host's devices (the same jitted generate function CO
     runs, one dispatch per host, all issued from the controller's one Python thread);
  2. gathers every rollout to its own memory (`device_get`: the Pathways gather, timed as network);
  3. detokenises, scores and normalises *all* samples on its own CPU;
  4. re-shards the global batch onto the global mesh and runs the same jitted train step.
Nothing is slowed down on purpose: SC pays only for what a single controller must do itself.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from locojax import metrics as m
from locojax.modes.co import CHECKSUM_KEY
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
from locojax.modes.run_files import RunResult, cancel_requested, finish, make_logger, start_output
from locojax.rollout import RolloutResult, rollout_key
from locojax.spec import RunSpec
from locojax.train import make_logprobs_fn


def host_device_groups(hosts: int, devices_per_host: int) -> list[list[jax.Device]]:
    devices = jax.devices()
    if len(devices) < hosts * devices_per_host:
        raise ValueError(f"SC needs {hosts} x {devices_per_host} devices in the controller, found {len(devices)}")
    return [devices[h * devices_per_host:(h + 1) * devices_per_host] for h in range(hosts)]


def run_sc(
    spec: RunSpec,
    *,
    resume: bool = False,
    console: bool = True,
    cancel_file: str | Path | None = None,
    extra_sinks: Sequence[m.MetricSink] = (),
) -> RunResult:
    if jax.process_count() != 1:
        raise ValueError("SC mode runs in one controller process; start it with `locojax train`, not `launch`")
    hosts, per_host = spec.placement.hosts, spec.placement.devices_per_host
    groups = host_device_groups(hosts, per_host)
    out = start_output(spec, 0)
    trainer = prepare_trainer(spec, [d for group in groups for d in group], out / "checkpoints", resume)
    prompts_per_host = spec.rollout.prompts_per_step // hosts
    rows_per_host = prompts_per_host * spec.rollout.group_size
    runners = [RolloutRunner(spec, trainer.policy, prompts_per_host, group) for group in groups]
    use_kl = spec.algo.kl_coef > 0
    if use_kl:
        # The frozen reference is the starting policy, as in CO, and the same jitted log-prob kernel.
        # The controller holds it replicated on the global mesh and scores the whole re-sharded batch
        # with one dispatch (CO scores each host's rows on that host instead).
        reference_params = trainer.reference_params
        reference_logprobs = make_logprobs_fn(trainer.policy.graphdef, train_temperature(spec))

    logger = make_logger(spec, out, 0, trainer.start_step, console, extra_sinks)
    timer = m.PhaseTimer()
    # The controller is one host: it gets the same reward pool one CO host gets.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
    status, steps_done, combined = "succeeded", trainer.start_step, {}
    try:
        for step in range(trainer.start_step, spec.steps):
            with timer.step():
                with timer.phase(m.TIME_ROLLOUT):
                    examples = [prompts_for(trainer.task, spec, step, h, hosts) for h in range(hosts)]
                    with timer.device() as span:
                        # Every input is placed before any rollout is dispatched: the key and the params
                        # copies come from the first device, and a copy or a key made after host 0's
                        # rollout was queued there would wait for that rollout, so the hosts would
                        # decode one after another instead of at once (measured: 2 hosts took 2x one).
                        key = rollout_key(spec.seed, step)
                        host_params = [to_local(trainer.state.params, runner.replicated) for runner in runners]
                        dispatched = [runner.sample(host_params[h], examples[h], key, h * rows_per_host)
                                      for h, runner in enumerate(runners)]
                        span.ready([result for _, _, result in dispatched])
                    with timer.network():
                        # Every rollout travels back to the controller.
                        gathered = [(tokens, mask, jax.tree.map(np.asarray, jax.device_get(result)))
                                    for tokens, mask, result in dispatched]
                    completions = [runners[h].completions(gathered[h][2]) for h in range(hosts)]
                rollout_s = timer.last_phase(m.TIME_ROLLOUT)
                all_examples = [e for host_examples in examples for e in host_examples]
                all_completions = [c for host_completions in completions for c in host_completions]
                rewards, per_fn, advantages = score_and_normalise(
                    spec, trainer.task, all_examples, all_completions, pool, timer)
                tokens = np.concatenate([g[0] for g in gathered])
                mask = np.concatenate([g[1] for g in gathered])
                result = RolloutResult(*(np.concatenate([getattr(g[2], f) for g in gathered])
                                         for f in ("tokens", "logprobs", "mask", "lengths")))
                piece = HostRollout(all_examples, tokens, mask, result, all_completions, rewards, per_fn,
                                    advantages)
                rows = piece.batch()
                with timer.device(m.TIME_TRAIN) as span:
                    batch = trainer.global_batch(rows)
                    if use_kl:
                        batch["ref_logprobs"] = reference_logprobs(
                            reference_params, batch["tokens"], batch["prompt_mask"], batch["completion_mask"])
                    trainer.state, train_metrics = trainer.train_step(trainer.state, batch)
                    span.ready(trainer.state)
                with timer.phase(m.TIME_CHECKPOINT):
                    trainer.checkpoint(spec, force=step + 1 == spec.steps)
                record = {**piece.metrics(spec.rollout.group_size, rollout_s, trainer.policy.tokenizer.eos_id),
                          **jax.device_get(train_metrics)}
                record[CHECKSUM_KEY] = params_checksum(trainer.state.params)
            record = {k: float(v) for k, v in record.items()}
            record.update(timer.metrics())
            train_tokens = int(rows["prompt_mask"].sum() + rows["completion_mask"].sum())
            record[m.THROUGHPUT_TRAIN_TOKENS] = m.throughput(train_tokens, record.get(m.TIME_TRAIN, 0.0))
            combined = logger.log_hosts(step, [record])
            steps_done = step + 1
            if cancel_requested(cancel_file):
                status = "cancelled"
                trainer.checkpoint(spec, force=True)
                break
        trainer.checkpoints.wait_until_finished()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        logger.close()
        trainer.checkpoints.close()
    return finish(out, 0, RunResult(status, steps_done, trainer.checkpoints.latest_step(), combined))
