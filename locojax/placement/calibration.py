"""Calibration: refit a hardware profile's host and network constants from measured steps.

A measured run is its RunSpec plus the per-step metric records it wrote (`metrics.jsonl`: one flat
JSON object per line, `{"step": 3, "host": "all", "time/step": ..., "time/host": ..., ...}`; later the
database feeds the same records). For each run the cost model says how many of each constant the
critical path holds (controller round trips, DCN bytes, ...); the constants are fitted so that the
predicted `time/step`, `time/host` and `time/network` meet the measured ones (`calibrate`), with a
weak pull towards the current values so that constants a set of runs cannot tell apart keep their
prior ratio. Device rates come from the probe and are not refitted one by one; one factor,
`device_time_scale`, says how much slower or faster than the probe the devices ran in the measured runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from locojax import contract as c
from locojax.contract import METRICS_FILE, SPEC_FILE
from locojax.model.config import PRESETS
from locojax.placement.cost_model import (
    HOST_CONSTANTS,
    MODE_COSTS,
    NETWORK_CONSTANTS,
    ModelSize,
    Placement,
    StepEstimate,
    constant_values,
    estimate_step,
)
from locojax.placement.hardware import HardwareProfile
from locojax.placement.workloads import WORKLOADS, WorkloadProfile
from locojax.spec import RunSpec, load_spec, parse_spec

# Steps dropped from the front of a run: the first one compiles.
DEFAULT_SKIP_STEPS = 1
# Weight of the pull towards the current constants: per squared log-multiplier, against squared errors
# as fractions of a step. Weak: a constant moved 100x costs what a 0.5% step error does, so the runs
# decide whatever they can tell apart and the pull only holds what they cannot.
DEFAULT_REGULARIZATION = 1e-6
# A constant at zero still needs a scale to fit against.
_FLOOR = {"dcn_s_per_byte": 1e-12, "ici_s_per_byte": 1e-13, "pcie_s_per_byte": 1e-12}


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    spec: RunSpec
    records: tuple[Mapping[str, Any], ...]
    source: str = "records"

    @classmethod
    def from_records(cls, spec: RunSpec | Mapping[str, Any], records: Iterable[Mapping[str, Any]],
                     source: str = "records") -> "MeasuredRun":
        if not isinstance(spec, RunSpec):
            spec = parse_spec(dict(spec))
        return cls(spec=spec, records=tuple(records), source=source)


def load_run(run_dir: str | Path) -> MeasuredRun:
    """A run directory written by the engine: `spec.yaml` and `metrics.jsonl`."""
    run_dir = Path(run_dir)
    spec = load_spec(run_dir / SPEC_FILE)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise ValueError(f"{metrics_path}: not found")
    records = []
    for number, line in enumerate(metrics_path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{metrics_path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{metrics_path}:{number}: expected a JSON object")
        records.append(record)
    return MeasuredRun(spec=spec, records=tuple(records), source=str(run_dir))


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """Median per-step times of a run (NaN where the records do not have the metric)."""

    step_s: float
    device_s: float
    host_s: float
    network_s: float
    steps: int
    completion_len_mean: float | None = None


_METRIC_KEYS = {"step_s": c.TIME_STEP, "device_s": c.TIME_DEVICE, "host_s": c.TIME_HOST, "network_s": c.TIME_NETWORK}


def _saving(record: Mapping[str, Any], key: str) -> float:
    """The checkpoint save inside a step's `time/step` and `time/host` (the engine counts it as host
    time): the cost model predicts steps without saves, and a run's last step always saves one."""
    if key in (c.TIME_STEP, c.TIME_HOST):
        return float(record.get(c.TIME_CHECKPOINT) or 0.0)
    return 0.0


def summarize(records: Sequence[Mapping[str, Any]], skip_steps: int = DEFAULT_SKIP_STEPS) -> StepMeasurement:
    """Medians over steps of the aggregated rows (`host == "all"`), or of per-host means without them,
    with checkpoint saves taken out of the step and host times (see `_saving`)."""
    aggregated = [r for r in records if r.get("host", "all") == "all"]
    by_step: dict[int, list[Mapping[str, Any]]] = {}
    for record in aggregated or records:
        if "step" not in record:
            raise ValueError(f"metric record without 'step': {dict(record)}")
        by_step.setdefault(int(record["step"]), []).append(record)
    steps = sorted(by_step)
    if len(steps) > skip_steps:
        steps = steps[skip_steps:]

    def per_step(key: str) -> list[float]:
        values = []
        for step in steps:
            found = [float(r[key]) - _saving(r, key) for r in by_step[step] if r.get(key) is not None]
            if found:
                values.append(sum(found) / len(found))
        return values

    medians = {}
    for field, key in _METRIC_KEYS.items():
        values = per_step(key)
        medians[field] = statistics.median(values) if values else math.nan
    if math.isnan(medians["step_s"]):
        raise ValueError("metric records have no 'time/step'")
    lengths = per_step(c.COMPLETION_LEN_MEAN)
    return StepMeasurement(steps=len(steps), completion_len_mean=statistics.median(lengths) if lengths else None,
                           **medians)


def workload_for_spec(spec: RunSpec, completion_len_mean: float | None = None) -> WorkloadProfile:
    """The workload a RunSpec runs: its task's profile (reward cost) with the spec's batch and lengths."""
    base = WORKLOADS.get(spec.task.name) if spec.task.name in WORKLOADS else WORKLOADS.get("arith")
    if spec.task.reward and len(spec.task.reward) > 1:  # each reward function parses every completion
        base = base.replace(reward_s_per_sample=base.reward_s_per_sample * len(spec.task.reward))
    gen_len = spec.rollout.max_new_tokens
    mean = round(completion_len_mean) if completion_len_mean else min(base.gen_len_mean, gen_len)
    return base.replace(prompts_per_step=spec.rollout.prompts_per_step, group_size=spec.rollout.group_size,
                        prompt_len=spec.rollout.max_prompt_tokens, gen_len=gen_len,
                        gen_len_mean=max(1, min(mean, gen_len)))


def placement_for_spec(spec: RunSpec) -> Placement:
    p = spec.placement
    fraction = (p.rollout_fraction if p.rollout_fraction is not None else 0.5) \
        if MODE_COSTS.get(p.mode).rollout_groups else None
    return Placement(p.mode, p.hosts * p.devices_per_host, p.devices_per_host, fraction)


@dataclasses.dataclass(frozen=True)
class Observation:
    """One measured configuration: what ran, and its median step times."""

    model: ModelSize
    workload: WorkloadProfile
    placement: Placement
    measured: StepMeasurement
    label: str = ""
    # How much slower than at profile time the devices ran during this run (a shared machine under
    # other load, measured by re-timing the probe's reference kernels around the run); 1 if unknown.
    device_time_scale: float = 1.0

    def predict(self, hardware: HardwareProfile) -> StepEstimate:
        if self.device_time_scale != 1.0:
            hardware = hardware.replace(device_time_scale=hardware.device_time_scale * self.device_time_scale)
        return estimate_step(self.model, hardware, self.workload, self.placement)


def observation_for_run(run: MeasuredRun, skip_steps: int = DEFAULT_SKIP_STEPS) -> Observation:
    measured = summarize(run.records, skip_steps)
    spec = run.spec
    return Observation(model=ModelSize.from_config(PRESETS[spec.model.preset]),
                       workload=workload_for_spec(spec, measured.completion_len_mean),
                       placement=placement_for_spec(spec), measured=measured, label=run.source)


@dataclasses.dataclass(frozen=True)
class FitError:
    """Root-mean-square error over runs, each as a fraction of the run's measured step time."""

    step: float
    host: float
    network: float


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
    profile: HardwareProfile
    constants: dict[str, float]  # fitted values, by the cost model's constant names
    before: FitError
    after: FitError
    observations: int

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile.to_json(), "constants": self.constants,
                "fit_error_before": dataclasses.asdict(self.before),
                "fit_error_after": dataclasses.asdict(self.after), "observations": self.observations}


def fit_error(hardware: HardwareProfile, observations: Sequence[Observation]) -> FitError:
    errors: dict[str, list[float]] = {"step": [], "host": [], "network": []}
    for obs in observations:
        predicted = obs.predict(hardware)
        scale = obs.measured.step_s
        for name, pred, meas in (("step", predicted.step_s, obs.measured.step_s),
                                 ("host", predicted.host_s, obs.measured.host_s),
                                 ("network", predicted.network_s, obs.measured.network_s)):
            if not math.isnan(meas):
                errors[name].append((pred - meas) / scale)

    def rms(values: list[float]) -> float:
        return math.sqrt(sum(v * v for v in values) / len(values)) if values else math.nan

    return FitError(**{name: rms(values) for name, values in errors.items()})


def with_constants(hardware: HardwareProfile, constants: Mapping[str, float]) -> HardwareProfile:
    """The profile with cost-model constants (by name) written back into its fields."""
    changes: dict[str, float] = {}
    for name, value in constants.items():
        if name in _FLOOR:  # a bandwidth: a fitted zero would mean infinitely fast
            value = max(value, _FLOOR[name])
        if name == "dcn_s_per_byte":
            changes["dcn_bandwidth_per_chip"] = 1.0 / (value * hardware.chips_per_host)
        elif name == "ici_s_per_byte":
            changes["ici_bandwidth"] = 1.0 / value
        elif name == "pcie_s_per_byte":
            changes["pcie_bandwidth"] = 1.0 / value
        else:
            changes[name] = value
    return hardware.replace(**changes)


def _fitted_names(hardware: HardwareProfile, observations: Sequence[Observation]) -> list[str]:
    """The host and network constants some observation's critical path counts (the others cannot be
    told from these runs and keep their values)."""
    used: set[str] = set()
    for obs in observations:
        path = obs.predict(hardware).critical_path
        used |= {name for name, count in {**path.host, **path.network}.items() if count}
    return [name for name in (*HOST_CONSTANTS, *NETWORK_CONSTANTS) if name in used]


def _residuals(hardware: HardwareProfile, observations: Sequence[Observation]) -> list[float]:
    """Each run's step, host and network error as a fraction of its measured step. The host/network
    split is compared only where the engine times it as the model counts it (`ModeCost.split_comparable`)."""
    out = []
    for obs in observations:
        measured = obs.measured
        predicted = obs.predict(hardware)
        out.append((predicted.step_s - measured.step_s) / measured.step_s)
        if MODE_COSTS.get(obs.placement.mode).split_comparable:
            for pred, meas in ((predicted.host_s, measured.host_s), (predicted.network_s, measured.network_s)):
                if not math.isnan(meas):
                    out.append((pred - meas) / measured.step_s)
    return out


def calibrate(hardware: HardwareProfile, observations: Sequence[Observation],
              regularization: float = DEFAULT_REGULARIZATION, fit_device_scale: bool = True) -> CalibrationResult:
    """Refit `hardware`'s host and network constants to the observations, and (`fit_device_scale`) how
    fast the devices ran in them relative to the profile's rates (`device_time_scale`: a probe times
    kernels in isolation, minutes or hours away from the runs, and this machine's speed drifts by tens
    of % over that); report the fit error.

    One nonlinear least squares over the log of each value's multiplier, on every run's step, host and
    network error (`_residuals`), with a weak pull towards the current values. The counts themselves
    depend on the constants (which DA branch is critical, how much reward decode hides), so fitting
    the counts at fixed constants, over and over, need not settle: on the coordination benchmark's runs
    it flipped between two solutions on every pass."""
    from scipy.optimize import least_squares

    if not observations:
        raise ValueError("calibration needs at least one measured run")
    before = fit_error(hardware, observations)
    current = constant_values(hardware)
    start = {name: max(current[name], _FLOOR.get(name, 1e-9)) for name in _fitted_names(hardware, observations)}
    if fit_device_scale:
        start["device_time_scale"] = hardware.device_time_scale
    names = list(start)

    def profile(log_multipliers: np.ndarray) -> HardwareProfile:
        values = {name: start[name] * math.exp(x) for name, x in zip(names, log_multipliers)}
        scale = values.pop("device_time_scale", hardware.device_time_scale)
        return with_constants(hardware, values).replace(device_time_scale=scale)

    pull = math.sqrt(regularization)

    def objective(x: np.ndarray) -> np.ndarray:
        return np.concatenate([_residuals(profile(x), observations), pull * x])

    fit = least_squares(objective, np.zeros(len(names)), bounds=(-25.0, 25.0))
    fitted = profile(fit.x)
    constants = {name: start[name] * math.exp(x) for name, x in zip(names, fit.x)}
    return CalibrationResult(profile=fitted, constants=constants, before=before,
                             after=fit_error(fitted, observations), observations=len(observations))


def calibrate_runs(hardware: HardwareProfile, runs: Sequence[MeasuredRun | str | Path],
                   skip_steps: int = DEFAULT_SKIP_STEPS,
                   regularization: float = DEFAULT_REGULARIZATION) -> CalibrationResult:
    """Calibrate from run directories and/or `MeasuredRun`s (records fed directly)."""
    loaded = [run if isinstance(run, MeasuredRun) else load_run(run) for run in runs]
    return calibrate(hardware, [observation_for_run(run, skip_steps) for run in loaded], regularization)
