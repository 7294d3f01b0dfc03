"""Metric names, phase timers, the device/host/network split, and reporters.

This module owns (1) every per-step metric name of DESIGN §6, defined once below with its meaning
and how it aggregates across hosts, (2) `PhaseTimer`, which measures wall time per phase and the
paper's split, (3) `split_step_time`, the one definition of that split, and (4) the sinks a run
reports to (console progress bar, JSONL file, anything implementing `MetricSink`, e.g. the
control plane's HTTP sink) behind one `MetricsLogger`.

Records are flat: `{"step": 3, "host": 0, "time/step": 0.41, "reward/mean": 0.2, ...}`; `step` is
the 0-based index of the step the values describe (after it, `TrainState.step == step + 1`), `host`
the process index, or "all" for the aggregate over hosts (`aggregate_hosts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

Aggregation = Literal["mean", "max", "sum", "min", "ratio"]
Split = Literal["device", "network"]
Host = int | str  # a process index, or ALL_HOSTS for the aggregate
ALL_HOSTS = "all"


@dataclasses.dataclass(frozen=True)
class MetricInfo:
    name: str
    unit: str
    across_hosts: Aggregation
    description: str


METRICS: dict[str, MetricInfo] = {}
# A "ratio" metric's (numerator, denominator) metric names: across hosts it is sum(numerator) /
# sum(denominator), so H hosts report exactly what one host would on the same items.
RATIO_PARTS: dict[str, tuple[str, str]] = {}


def _define(name: str, unit: str, across_hosts: Aggregation, description: str) -> str:
    METRICS[name] = MetricInfo(name, unit, across_hosts, description)
    return name


# --- time: wall seconds per step. Phases may nest inside others; they are not a partition. -------
# A synchronous step is as slow as its slowest host, hence max for time/step; phase times are means.
TIME_STEP = _define("time/step", "s", "max", "wall time of the whole step on this host")
TIME_ROLLOUT = _define("time/rollout", "s", "mean", "prompt sharding, prefill and decode, incl. detokenisation")
TIME_REWARD = _define("time/reward", "s", "mean", "reward scoring on the host CPU")
TIME_ADVANTAGE = _define("time/advantage", "s", "mean", "group-normalised advantages")
TIME_TRAIN = _define("time/train", "s", "mean", "global batch assembly and the train step (incl. its all-reduce)")
TIME_WEIGHT_SYNC = _define("time/weight_sync", "s", "mean", "DA: pushing new weights to rollout hosts")
TIME_CHECKPOINT = _define("time/checkpoint", "s", "mean", "blocking part of a checkpoint save")
# The paper's split; see `split_step_time` for the definition.
TIME_DEVICE = _define("time/device", "s", "mean", "devices busy: device computations timed up to block_until_ready")
TIME_NETWORK = _define("time/network", "s", "mean", "collectives and weight transfers timed on their own")
TIME_HOST = _define("time/host", "s", "mean", "step minus device minus network: host orchestration while devices wait")

# --- throughput: each host's tokens over the same synchronous step, so the global rate is the sum.
THROUGHPUT_ROLLOUT_TOKENS = _define(
    "throughput/rollout_tokens_per_s", "tokens/s", "sum", "generated completion tokens / time/rollout")
THROUGHPUT_TRAIN_TOKENS = _define(
    "throughput/train_tokens_per_s", "tokens/s", "sum", "prompt+completion tokens trained / time/train")

# --- rewards: every host scores equally many samples, so the mean of host means is the global
# mean; reward/std aggregated as a mean of host stds is an approximation (it omits the spread
# between host means).
REWARD_MEAN = _define("reward/mean", "", "mean", "mean total reward over the step's samples")
REWARD_STD = _define("reward/std", "", "mean", "std of total reward over the step's samples (ddof=0)")
REWARD_FRAC_ZERO_STD = _define(
    "reward/frac_zero_std", "", "mean", "fraction of groups whose rewards are all equal (zero advantage)")
REWARD_FN_MEAN_PATTERN = "reward/{fn}/mean"  # per reward function; aggregated as a mean


def reward_fn_mean(fn: str) -> str:
    """`reward/<fn>/mean`: the mean of one reward function's scores."""
    return REWARD_FN_MEAN_PATTERN.format(fn=fn)


# --- train step outputs: one SPMD step computes them over the global batch, so hosts agree.
LOSS_POLICY = _define("loss/policy", "", "mean", "clipped surrogate loss under the chosen aggregation")
LOSS_KL = _define("loss/kl", "", "mean", "k3 KL to the reference policy under the chosen aggregation (before kl_coef)")
LOSS_TOTAL = _define("loss/total", "", "mean", "loss/policy + kl_coef * loss/kl")
LOSS_SFT = _define("loss/sft", "nats", "mean", "teacher-forced cross-entropy per completion token")
POLICY_ENTROPY = _define("policy/entropy", "nats", "mean", "token-mean entropy of the trained policy (at temperature)")
POLICY_CLIP_FRAC = _define(
    "policy/clip_frac", "", "mean", "fraction of completion tokens whose gradient the ratio clip zeroed")
POLICY_GRAD_NORM = _define("policy/grad_norm", "", "mean", "global gradient norm before clipping")
OPTIM_LR = _define("optim/lr", "", "mean", "learning rate of this step's update(s)")

# --- completions
COMPLETION_LEN_MEAN = _define("completion/len_mean", "tokens", "mean", "mean completion length incl. EOS")
COMPLETION_LEN_MAX = _define("completion/len_max", "tokens", "max", "longest completion")
COMPLETION_CLIPPED_FRAC = _define(
    "completion/clipped_frac", "", "mean", "fraction of completions cut at max_new_tokens without EOS")

# --- DA only
DA_STALENESS = _define("da/staleness", "steps", "max", "policy versions between sampling and training (<= 1)")
DA_ROLLOUT_IDLE = _define("da/rollout_idle", "s", "mean", "rollout hosts waiting for new weights")
DA_TRAIN_IDLE = _define("da/train_idle", "s", "mean", "train hosts waiting for a rollout batch")


# --- held-out evaluation (locojax.evaluate). Hosts evaluate disjoint shards of the held-out prompts;
# their counts are summed and the ratios recomputed from the sums, never averaged. Recorded in step
# t's record they describe the policy step t started from (t updates applied); the evaluation after
# the last step is a record of its own at step = steps.
EVAL_PROMPTS = _define("eval/prompts", "prompts", "sum", "held-out prompts evaluated")
EVAL_CORRECT = _define("eval/correct", "prompts", "sum", "held-out prompts the greedy completion answers right")
EVAL_PASS_CORRECT = _define(
    "eval/pass@k_correct", "prompts", "sum", "held-out prompts with a right answer among the k attempts")
EVAL_ACCURACY = _define("eval/accuracy", "", "ratio", "eval/correct / eval/prompts: greedy accuracy")
EVAL_PASS_AT_K = _define(
    "eval/pass@k", "", "ratio", "eval/pass@k_correct / eval/prompts: right in at least one of k attempts "
    "(the greedy completion and k-1 samples at eval.temperature)")
EVAL_TIME = _define("time/eval", "s", "max", "wall time of one evaluation (outside time/step)")
RATIO_PARTS[EVAL_ACCURACY] = (EVAL_CORRECT, EVAL_PROMPTS)
RATIO_PARTS[EVAL_PASS_AT_K] = (EVAL_PASS_CORRECT, EVAL_PROMPTS)


def across_hosts(name: str) -> Aggregation:
    """How metric `name` aggregates across hosts; unknown names (e.g. reward/<fn>/mean) use the mean."""
    info = METRICS.get(name)
    return info.across_hosts if info else "mean"


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
        """Seconds recorded so far in this step for phase `name` (0 if it has not run)."""
        return self._phases.get(name, 0.0)

    def last_phase(self, name: str) -> float:
        """Seconds recorded under phase `name` in the current (or, after it, the last) step so far;
        0.0 if it was not entered. For per-phase rates inside a step, e.g. rollout tokens/s."""
        return self._phases.get(name, 0.0)

    def metrics(self) -> dict[str, float]:
        """time/* of the last finished step."""
        return dict(self._last)


def throughput(tokens: float, seconds: float) -> float:
    return float(tokens) / seconds if seconds > 0 else 0.0


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


def _json_value(value: Any) -> Any:
    value = float(value)
    return value if math.isfinite(value) else None  # JSON has no NaN/inf


class JsonlSink:
    """One flat JSON object per line: {"step": 3, "host": 0, "time/step": ..., ...}; non-finite
    values are written as null. The placement calibration reads exactly this format."""

    def __init__(self, path: str | Path, *, append: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w", encoding="utf-8")

    def write(self, step: int, host: Host, metrics: Mapping[str, float]) -> None:
        record = {"step": int(step), "host": host, **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()  # a killed run keeps every finished step

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class ConsoleSink:
    """A `rich` live progress bar: step / total, reward/mean and time/step of one host's records
    (default: the aggregate "all")."""

    def __init__(self, total_steps: int, *, host: Host = ALL_HOSTS, description: str = "train", console=None,
                 start_step: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.host = host
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"), TextColumn("step {task.fields[step_time]}"),
            TimeRemainingColumn(), console=console, transient=False,
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

    def close(self) -> None:
        self._progress.stop()


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
