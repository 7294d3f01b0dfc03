"""Phase timers, the device/host/network split, and reporters.

The per-step metric names of DESIGN §6 are defined once, with their meaning and how they aggregate
across hosts, in the jax-free `locojax.contract` (re-exported here, so `m.TIME_STEP` reads as before).
This module owns (1) the host-side summaries whose definitions belong with those names, (2)
`PhaseTimer`, which measures wall time per phase and the paper's split, (3) `split_step_time`, the one definition of that split, and (4) the sinks a run
reports to (console progress bar, JSONL file, anything implementing `MetricSink`, e.g. the
control plane's HTTP sink) behind one `MetricsLogger`.

Records are flat: `{"step": 3, "host": 0, "time/step": 0.41, "reward/mean": 0.2, ...}`; `step` is
the 0-based index of the step the values describe (after it, `TrainState.step == step + 1`), `host`
the process index, or "all" for the aggregate over hosts (`aggregate_hosts`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from locojax.contract import (  # the names are defined once, in the jax-free contract
    ALL_HOSTS, Aggregation, COMPLETION_CLIPPED_FRAC, COMPLETION_LEN_MAX, COMPLETION_LEN_MEAN, DA_ROLLOUT_IDLE,
    DA_STALENESS, DA_TRAIN_IDLE, DA_WEIGHT_SYNC_BYTES, EVAL_ACCURACY, EVAL_CORRECT, EVAL_PASS_AT_K, EVAL_PASS_CORRECT, EVAL_PROMPTS,
    EVAL_TIME, MEMORY_DEVICE_PEAK, METRICS, RATIO_PARTS, Host, JsonlSink, LOSS_KL, LOSS_POLICY, LOSS_SFT, LOSS_TOTAL, MetricInfo, OPTIM_LR,
    POLICY_CLIP_FRAC, POLICY_ENTROPY, POLICY_GRAD_NORM, REWARD_FN_MEAN_PATTERN, REWARD_FRAC_ZERO_STD,
    REWARD_MEAN, REWARD_STD, Split, THROUGHPUT_ROLLOUT_TOKENS, THROUGHPUT_TRAIN_TOKENS, TIME_ADVANTAGE,
    TIME_CHECKPOINT, TIME_DEVICE, TIME_HOST, TIME_NETWORK, TIME_REWARD, TIME_ROLLOUT, TIME_SETUP, TIME_SETUP_BACKEND,
    TIME_SETUP_COMPILE, TIME_SETUP_MODEL, SETUP_PARTS, TIME_STEP, TIME_TRAIN,
    TIME_WEIGHT_SYNC, across_hosts, read_jsonl, reward_fn_mean,
)
from locojax.contract import SC_WORKER_SAMPLE, SC_WORKER_TRAIN  # noqa: F401  (SC's worker rows)


# ------------------------------------------------------------------------------------------------
# The split


def split_step_time(step_s: float, device_s: float, network_s: float) -> dict[str, float]:
    """The paper's device / host / network split of one step. THE definition; everything calls this.

    time/device  — time the devices were busy: the wall time of device computations (rollout
                   prefill+decode, reference log-probs, the train step), each timed from dispatch
                   until `block_until_ready` of its outputs. Dispatch of a computation is included
                   (it is short next to the computation and cannot be separated without a profiler).
    time/network — collectives and weight transfers measured on their own: a timed barrier or
                   all-reduce, a DA weight push, a metrics gather. The gradient all-reduce fused into
                   the SPMD train step is NOT separable and counts as device time.
    time/host    — step wall time minus device minus network: host work while devices wait (reward
                   scoring, tokenisation, batching, Python dispatch, checkpoint bookkeeping). Clamped
                   at 0 against timer jitter.
    Overlapped host and device work (e.g. rewards scored while the device decodes) counts once, as
    device, since the device-timed span covers it.
    """
    host_s = max(0.0, step_s - device_s - network_s)
    return {TIME_STEP: step_s, TIME_DEVICE: device_s, TIME_NETWORK: network_s, TIME_HOST: host_s}


class Span:
    """Handle of one timed region: `ready(x)` blocks until device outputs x are computed, so the
    region ends when the devices are done, not when dispatch returns."""

    def ready(self, outputs: Any) -> Any:
        return jax.block_until_ready(outputs)


class PhaseTimer:
    """Wall time per named phase and the device/network totals of one step.

        timer = PhaseTimer()
        with timer.step():
            with timer.phase(TIME_ROLLOUT):
                with timer.device() as span:            # device busy
                    out = span.ready(decode(params, prompts))
                texts = detokenize(out)                  # host
            with timer.phase(TIME_REWARD):
                rewards = score(texts)                   # host
            with timer.phase(TIME_TRAIN, split="device") as span:
                state, stats = span.ready(train_step(state, batch))
        record = timer.metrics()   # time/step, time/rollout, ..., time/device, time/host, time/network

    A phase name is a metric name (e.g. TIME_ROLLOUT); the same name entered twice in a step adds up.
    Split spans (`device()`, `network()`, or `phase(..., split=...)`) inside another split span are
    not counted again: the outermost one owns the time.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._phases: dict[str, float] = {}
        self._split = {"device": 0.0, "network": 0.0}
        self._split_depth = 0
        self._step_start: float | None = None
        self._last: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self) -> Iterator["PhaseTimer"]:
        self._phases = {}
        self._split = {"device": 0.0, "network": 0.0}
        self._split_depth = 0
        self._step_start = self._clock()
        try:
            yield self
        finally:
            step_s = self._clock() - self._step_start
            self._step_start = None
            self._last = {**self._phases, **split_step_time(step_s, self._split["device"], self._split["network"])}

    @contextlib.contextmanager
    def phase(self, name: str | None, *, split: Split | None = None) -> Iterator[Span]:
        """Time a region; `name` (a metric name, or None) records it as a phase; `split` also
        counts it as device or network time."""
        if split is not None and split not in self._split:
            raise ValueError(f"split must be 'device' or 'network', got {split!r}")
        counts = split is not None and self._split_depth == 0
        if split is not None:
            self._split_depth += 1
        start = self._clock()
        try:
            yield Span()
        finally:
            elapsed = self._clock() - start
            if split is not None:
                self._split_depth -= 1
            if counts:
                self._split[split] += elapsed
            if name is not None:
                self._phases[name] = self._phases.get(name, 0.0) + elapsed

    def device(self, name: str | None = None) -> contextlib.AbstractContextManager[Span]:
        """A region where the devices are busy; end it with `span.ready(outputs)`."""
        return self.phase(name, split="device")

    def network(self, name: str | None = None) -> contextlib.AbstractContextManager[Span]:
        """A collective or weight transfer; end it with `span.ready(outputs)`."""
        return self.phase(name, split="network")

    def last_phase(self, name: str) -> float:
        """Seconds recorded under phase `name` in the current (or, after it, the last) step so far;
        0.0 if it was not entered. For per-phase rates inside a step, e.g. rollout tokens/s."""
        return self._phases.get(name, 0.0)

    def clock(self) -> float:
        return self._clock()

    def credit_wait(self, wait_s: float, device_s: float) -> None:
        """A wait on other processes that measured their own device time (SC's controller on its
        workers): `device_s` of the wait counts as device, the rest as network. Inside another split
        span it is that span's time already."""
        if self._split_depth == 0:
            device_s = min(max(device_s, 0.0), wait_s)
            self._split["device"] += device_s
            self._split["network"] += wait_s - device_s

    def metrics(self) -> dict[str, float]:
        """time/* of the last finished step."""
        return dict(self._last)


def throughput(tokens: float, seconds: float) -> float:
    return float(tokens) / seconds if seconds > 0 else 0.0


def device_peak_bytes(stats: Mapping[str, Any]) -> float | None:
    """A device's peak from its runtime's statistics: the allocator's `peak_bytes_in_use` (buffers)
    plus `peak_bytes_reserved` where the runtime reports it. A TPU's runtime reserves each program's
    temporaries apart from the allocator's buffers: a program with 3.0 GiB of temporaries left
    `peak_bytes_in_use` unchanged and `peak_bytes_reserved` at 3.0 GiB (bench/tpu_memory_probe.py), so
    the in-use peak alone missed every activation, gradient and KV cache. The sum is what the memory
    plan forecasts: the buffers held, plus the largest program's temporaries."""
    in_use = stats.get("peak_bytes_in_use")
    if in_use is None:
        return None
    return float(in_use) + float(stats.get("peak_bytes_reserved") or 0)


def device_memory_metrics(devices: Sequence[Any]) -> dict[str, float]:
    """`memory/device_peak_gib`: the highest `device_peak_bytes` among `devices` (the figure the memory
    plan is a forecast of). Devices whose runtime reports no statistics (XLA:CPU) contribute nothing;
    with none reporting, the metric is left out rather than logged as 0."""
    peaks = [peak for device in devices if (peak := device_peak_bytes(device.memory_stats() or {})) is not None]
    return {MEMORY_DEVICE_PEAK: max(peaks) / 2**30} if peaks else {}


# ------------------------------------------------------------------------------------------------
# Host-side summaries whose definitions belong with the names


def reward_metrics(
    rewards: np.ndarray,  # [B] total reward per sample, grouped G at a time
    group_size: int,
    per_fn: Mapping[str, np.ndarray] | None = None,  # fn name -> [B]
) -> dict[str, float]:
    rewards = np.asarray(rewards, np.float64)
    groups = rewards.reshape(-1, group_size)
    out = {
        REWARD_MEAN: float(rewards.mean()),
        REWARD_STD: float(rewards.std()),
        REWARD_FRAC_ZERO_STD: float(np.mean(groups.max(axis=1) == groups.min(axis=1))),
    }
    for fn, scores in (per_fn or {}).items():
        out[reward_fn_mean(fn)] = float(np.mean(scores))
    return out


def completion_metrics(completion_mask: np.ndarray, finished: np.ndarray) -> dict[str, float]:
    """completion_mask [B, N] (True for completion tokens incl. EOS), finished [B] (EOS emitted)."""
    lengths = np.asarray(completion_mask).sum(axis=1)
    return {
        COMPLETION_LEN_MEAN: float(lengths.mean()),
        COMPLETION_LEN_MAX: float(lengths.max()),
        COMPLETION_CLIPPED_FRAC: float(1.0 - np.mean(np.asarray(finished, bool))),
    }


# ------------------------------------------------------------------------------------------------
# Aggregation across hosts


def aggregate_hosts(records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One record from per-host records, each metric reduced as `across_hosts(name)` says.

    A metric missing on some hosts is reduced over the hosts that have it. Keys `step`/`host` are
    not metrics and are dropped. A ratio metric is recomputed from its summed parts (`RATIO_PARTS`);
    without them on every host that has it, it falls back to the mean.
    """
    reducers = {"mean": np.mean, "max": np.max, "sum": np.sum, "min": np.min, "ratio": np.mean}
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(k for k in record if k not in ("step", "host")))
    out = {}
    for name in names:
        values = [float(r[name]) for r in records if name in r and r[name] is not None]
        if values:
            out[name] = float(reducers[across_hosts(name)](values))
    for name, (numerator, denominator) in RATIO_PARTS.items():
        having = [r for r in records if name in r]
        if having and all(numerator in r and denominator in r for r in having):
            total = sum(float(r[denominator]) for r in having)
            out[name] = sum(float(r[numerator]) for r in having) / total if total else float("nan")
    return out


def gather_host_metrics(record: Mapping[str, float]) -> list[dict[str, float]]:
    """Every process's record, on every process (a `process_allgather`; time it as network).

    All processes must pass the same metric names. Single-process runs return `[record]`.
    """
    if jax.process_count() == 1:
        return [dict(record)]
    from jax.experimental import multihost_utils

    names = sorted(record)
    values = np.asarray([float(record[k]) for k in names], np.float64)
    gathered = np.asarray(multihost_utils.process_allgather(values))  # [H, K]
    return [dict(zip(names, map(float, row))) for row in gathered]


# ------------------------------------------------------------------------------------------------
# Sinks


@runtime_checkable
class MetricSink(Protocol):
    """Where records go. `host` is a process index or "all". The control plane implements one over
    HTTP; `write` should not block the step for long (batch and retry in the background)."""

    def write(self, step: int, host: Host, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """A `rich` live progress bar: step / total, reward/mean and time/step of one host's records
    (default: the aggregate "all").

    The bar is drawn by the run loop's thread as it logs a step, at most every `redraw_s`, not by
    rich's refresh thread: that thread draws ten times a second (~0.7 ms of Python each here), and a
    draw that falls between the rollout's end and the update's dispatch keeps the run loop from the
    GIL while the chip waits (the TensorBoard sink's imports did the same on a TPU host)."""

    def __init__(self, total_steps: int, *, host: Host = ALL_HOSTS, description: str = "train", console=None,
                 start_step: int = 0, redraw_s: float = 0.5):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.host = host
        self.redraw_s = redraw_s
        self._drawn_at = time.monotonic()
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"), TextColumn("step {task.fields[step_time]}"),
            TimeRemainingColumn(), console=console, transient=False, auto_refresh=False,
        )
        self._task = self._progress.add_task(description, total=total_steps, completed=start_step,
                                             reward="-", step_time="-")
        self._progress.start()

    def write(self, step: int, host: Host, metrics: Mapping[str, float]) -> None:
        if host != self.host:
            return
        fields = {}
        if REWARD_MEAN in metrics:
            fields["reward"] = f"{float(metrics[REWARD_MEAN]):.3f}"
        if TIME_STEP in metrics:
            fields["step_time"] = f"{float(metrics[TIME_STEP]):.3f}s"
        self._progress.update(self._task, completed=step + 1, **fields)
        now = time.monotonic()
        if now - self._drawn_at >= self.redraw_s:
            self._progress.refresh()
            self._drawn_at = now

    def close(self) -> None:
        self._progress.stop()  # draws the last state


class MetricsLogger:
    """Fans records out to several sinks. A failing sink warns and does not stop training: a run
    must outlive a dashboard outage."""

    def __init__(self, sinks: Sequence[MetricSink] = ()):
        self.sinks = list(sinks)

    def log(self, step: int, metrics: Mapping[str, Any], host: Host = ALL_HOSTS) -> None:
        # One device_get for all device scalars, not a sync per value.
        flat = {k: float(v) for k, v in jax.device_get(dict(metrics)).items()}
        for sink in self.sinks:
            try:
                sink.write(step, host, flat)
            except Exception as exc:  # noqa: BLE001 — any sink failure is reported, never fatal
                warnings.warn(f"metric sink {type(sink).__name__} failed at step {step}: {exc!r}", stacklevel=2)

    def log_hosts(self, step: int, per_host: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Write each host's record (host = its index) and the aggregate ("all"); return the aggregate."""
        for host, record in enumerate(per_host):
            self.log(step, record, host)
        combined = aggregate_hosts([{k: float(v) for k, v in r.items()} for r in per_host])
        self.log(step, combined, ALL_HOSTS)
        return combined

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"closing metric sink {type(sink).__name__} failed: {exc!r}", stacklevel=2)
