"""The one run loop every mode shares: setup, resume, cancel agreement, metric logging, the timing
split, checkpoints and the finish. A mode (CO, SC, DA, SFT) supplies only what differs: its setup,
which returns a `ModeSession`, and that session's `step`.

One step, read top to bottom in `run` below:
  1. an evaluation when the session has one due (outside the step's timers);
  2. the *previous* step's checkpoint (`session.checkpoint`, which saves every `checkpoint.every`
     steps), taken only now that that step's metrics are logged, and timed in this step's
     `time/checkpoint`;
  3. `session.step(...)`: the mode's own work (rollout, reward, advantages, train; or SFT's batch and
     update), returning this host's record and the tokens it trained;
  4. this host's vote on cancellation joins its record, and `session.gather` brings every host's
     record to every host (CO: one all-gather, timed as network; one process: the record itself),
     so all hosts stop after the same step;
  5. the timing split and train throughput are added per host and host 0 writes each host's record
     and the aggregate to `metrics.jsonl`;
  6. Python's cyclic garbage collection (`StepCollector`), which the loop runs here and nowhere else.
After a cancelled step, or the last one: a forced checkpoint of its state; then, unless cancelled, a
final evaluation when the session has one; then `session.finish` (wait for checkpoints, SFT's
export), then `result.json`. `run_mode` runs a spec under the mode it names (`locojax.modes`).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax

from locojax import metrics as m
from locojax.contract import (
    CANCEL_KEY,
    CHECKPOINTS_DIR,
    METRICS_FILE,
    SPEC_FILE,
    TENSORBOARD_DIR,
    EngineStatus,
    HostStatus,
    RunResult,
    cancel_requested,
    write_environment,
    write_result,
)
from locojax.environment import describe as describe_environment
from locojax.modes import spec_mode
from locojax.spec import RunSpec, dump_spec
from locojax.tensorboard import TensorBoardSink, preload as preload_tensorboard


def output_dir(spec: RunSpec) -> Path:
    return Path(spec.output_dir or Path("runs") / spec.name)


def checkpoint_dir(spec: RunSpec) -> Path:
    return Path(spec.checkpoint.dir) if spec.checkpoint.dir else output_dir(spec) / CHECKPOINTS_DIR


def start_output(spec: RunSpec, host: int) -> Path:
    out = output_dir(spec)
    if host == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / SPEC_FILE).write_text(dump_spec(spec), encoding="utf-8")
        write_environment(out, describe_environment(spec))
    return out


def make_logger(spec: RunSpec, out: Path, host: int, start_step: int, console: bool,
                extra_sinks: Sequence[m.MetricSink]) -> m.MetricsLogger:
    """Host 0 writes the run's records (per host and aggregate) to metrics.jsonl and the console."""
    sinks = list(extra_sinks)
    if host == 0:
        sinks = [m.JsonlSink(out / METRICS_FILE), TensorBoardSink(out / TENSORBOARD_DIR)] + sinks
        if console:
            sinks.append(m.ConsoleSink(spec.steps, description=spec.name, start_step=start_step))
    return m.MetricsLogger(sinks)


def checksum_due(spec: RunSpec, step: int) -> bool:
    """Whether step `step` reports `params/checksum` (only when `debug.checksum_every` asks)."""
    every = spec.debug.checksum_every
    return every > 0 and step % every == 0


@dataclasses.dataclass
class StepOutput:
    """What one step of a mode hands back to the loop."""

    record: Mapping[str, Any]  # this host's metric values (device scalars are fine)
    train_tokens: float  # prompt + completion tokens trained, for throughput/train_tokens_per_s


class ModeSession:
    """A mode after its setup. The defaults are those of a single process that evaluates nothing;
    a mode overrides what differs."""

    host: int = 0  # this process's index; host 0 writes the run's files
    start_step: int = 0  # where a resumed run continues
    # SFT: a cancel that arrives during the last step still lets the run finish (and export).
    last_step_ignores_cancel: bool = False
    # Parts of time/setup the mode timed (contract's time/setup_*), reported beside it on the first step.
    setup_phases: Mapping[str, float] = {}

    def step(self, step: int, timer: m.PhaseTimer, where: HostStatus) -> StepOutput:
        raise NotImplementedError

    def checkpoint(self, force: bool) -> None:
        """Save when due (or when `force`). The loop calls it only after the previous step's metrics are
        logged, so a mode must never save inside its step. The default (a mode without state) does nothing."""

    def gather(self, record: Mapping[str, float]) -> list[dict[str, float]]:
        """Every host's record, on every host, in host order."""
        return [dict(record)]

    def evaluate(self, step: int, where: HostStatus) -> dict[str, float]:
        """A held-out evaluation before `step` when one is due; {} otherwise."""
        return {}

    def final_evaluation(self, where: HostStatus) -> dict[str, float] | None:
        """The evaluation after the last step of a run that succeeded, or None."""
        return None

    def finish(self, status: EngineStatus, steps_done: int, where: HostStatus) -> int | None:
        """Wait for pending saves (and export, SFT); return the last checkpointed step."""
        return None

    def close(self) -> None:
        """Release what setup took (threads, checkpoint managers, actors); runs after failures too."""


Setup = Callable[..., ModeSession]


class StepCollector:
    """Python's cyclic garbage collector between steps, not inside them (OLMo-core and Megatron also
    take it out of the step).

    Left to its thresholds, it ran in the middle of steps: a CO run at bench size a on CPU collected
    ~28 times a step (0.16 ms each), the second generation ~2.6 times (1.7 ms each, over everything
    setup built: 233k objects) and the whole heap twice in 8 steps (127 ms); on a TPU host such a
    pause between the rollout's end and the update's dispatch is the chip's idle time. Here automatic
    collection is off while the loop runs; after the first step (setup and the first step built what
    lives for the run: the model, programs, caches) one full collection, then `gc.freeze` keeps those
    objects out of every later collection; after each later step the young generations are collected,
    and every `full_every` steps everything not frozen, while the device works on what the step queued
    (CO's next rollout). Objects freed by reference counting are freed at once as ever; only garbage in
    cycles waits for the step's end. The collector's state is restored when the loop ends."""

    def __init__(self, full_every: int = 100):
        self.full_every = full_every
        self.started = self.frozen = self.was_enabled = False

    def start(self) -> None:
        self.was_enabled, self.started = gc.isenabled(), True
        gc.disable()

    def after_step(self, steps_done: int) -> None:
        if not self.frozen:
            gc.collect()
            gc.freeze()
            self.frozen = True
        else:
            gc.collect(2 if steps_done % self.full_every == 0 else 1)

    def stop(self) -> None:
        if self.frozen:
            gc.unfreeze()
        if self.started and self.was_enabled:
            gc.enable()
        self.started = self.frozen = False


def run(spec: RunSpec, setup: Setup, *, resume: bool = False, console: bool = True,
        cancel_file: str | Path | None = None, extra_sinks: Sequence[m.MetricSink] = (),
        **options: Any) -> RunResult:
    """Run (or resume) `spec` with the mode session `setup(spec, resume=..., **options)` returns."""
    preload_tensorboard()  # imported while the session compiles, not by the sink's thread during steps
    setup_started = time.perf_counter()
    session = setup(spec, resume=resume, **options)
    setup_s = time.perf_counter() - setup_started
    logger = where = None
    collector = StepCollector()
    try:
        host = session.host
        out = start_output(spec, host)
        logger = make_logger(spec, out, host, session.start_step, console, extra_sinks)
        timer = m.PhaseTimer()
        where = HostStatus(out, host)
        status, steps_done, combined = EngineStatus.SUCCEEDED, session.start_step, {}
        saved_through = session.start_step  # the state after this many steps is saved (or due no save)
        collector.start()
        for step in range(session.start_step, spec.steps):
            evaluation = session.evaluate(step, where)
            with timer.step():
                if saved_through < step:
                    # The previous step's state is saved only once that step's metrics are logged: a host
                    # lost in between costs a recomputed step on resume, never a step's metrics. Its time
                    # counts in this step's `time/checkpoint`.
                    where(step, "checkpoint")
                    with timer.phase(m.TIME_CHECKPOINT):
                        session.checkpoint(force=False)
                    saved_through = step
                output = session.step(step, timer, where)
                where(step, "metrics")
                record = {k: float(v) for k, v in jax.device_get(dict(output.record)).items()}
                record.update(m.device_memory_metrics(jax.local_devices()))
                record.update(evaluation)  # every host evaluates at the same steps: the names agree
                if step == session.start_step:  # compilation happens in setup (the compiled memory plan)
                    record[m.TIME_SETUP] = setup_s
                    record.update(session.setup_phases)
                record[CANCEL_KEY] = float(cancel_requested(cancel_file))
                with timer.network():
                    # Host 0 needs every host's record; the gather doubles as the agreement on
                    # cancellation, so all hosts stop after the same step.
                    gathered = session.gather(record)
            times = timer.metrics()
            all_times = session.gather(times) if len(gathered) > 1 else [times]
            for index, host_times in enumerate(all_times):
                # A mode that splits its own step (DA's driver) keeps its values.
                gathered[index] = row = {**host_times, **gathered[index]}
                if m.TIME_TRAIN in row:  # SC's worker rows carry their own figures, not the step's phases
                    row[m.THROUGHPUT_TRAIN_TOKENS] = m.throughput(output.train_tokens, row[m.TIME_TRAIN])
            cancel = any(row.pop(CANCEL_KEY, 0.0) for row in gathered)
            combined = logger.log_hosts(step, gathered) if host == 0 else m.aggregate_hosts(gathered)
            steps_done = step + 1
            collector.after_step(steps_done)
            if cancel and not (session.last_step_ignores_cancel and steps_done == spec.steps):
                status = EngineStatus.CANCELLED
                session.checkpoint(force=True)
                saved_through = steps_done
                break
        if saved_through < steps_done:
            session.checkpoint(force=True)  # the last step's state
        if status is EngineStatus.SUCCEEDED:
            final = session.final_evaluation(where)
            if final is not None:
                evaluated = session.gather(final)
                final = logger.log_hosts(spec.steps, evaluated) if host == 0 else m.aggregate_hosts(evaluated)
                combined = {**combined, **final}
        last_checkpoint = session.finish(status, steps_done, where)
    finally:
        collector.stop()
        if logger is not None:
            logger.close()
        if where is not None:
            where.close()
        session.close()
    checkpoint_bytes = None
    if host == 0 and last_checkpoint is not None:
        # What a checkpoint costs on disk (with LoRA: the adapters and their optimizer state alone).
        checkpoint_bytes = sum(f.stat().st_size for f in (checkpoint_dir(spec) / str(last_checkpoint)).rglob("*")
                               if f.is_file())
    result = RunResult(status.value, steps_done, last_checkpoint, combined, checkpoint_bytes)
    if host == 0:
        write_result(out, result)
    return result


def run_mode(spec: RunSpec, **options: Any) -> RunResult:
    """Run `spec` in this process under its mode, through the one run loop."""
    return run(spec, spec_mode(spec).session_class(), **options)
