"""Calibration: refit a hardware profile's constants from measured steps (its observations).

A measured run is its RunSpec plus the per-step metric records it wrote (`metrics.jsonl`: one flat
JSON object per line, `{"step": 3, "host": "all", "time/step": ..., "time/host": ..., ...}`; later the
database feeds the same records). For each run the cost model says how many of each constant the
critical path holds (controller round trips, DCN bytes, ...); the constants are fitted so that the
predicted `time/step`, `time/host` and `time/network` meet the measured ones (`calibrate`), with a
weak pull towards the current values so that constants a set of runs cannot tell apart keep their
prior ratio. What else is fitted depends on the profile (`FitRecipe`, `recipe_for`):
  * the local CPU (`shared_machine`): device rates come from the probe and are not refitted one by
    one; one factor, `device_time_scale`, says how much slower or faster than the probe the devices
    ran in the measured runs;
  * accelerators: their device constants too (train MFU, the fixed costs per train step, per decoder
    layer of a decode step, per vocabulary entry of each sequence decode samples and of each slot
    training scores, the HBM bandwidth decode reaches), against each run's measured phases
    (`time/rollout`, `time/train`, `time/reward`) as well as its step, so that runs of small models
    tell the fixed costs from the rates that larger ones are priced with.

An observation prices the run as this engine ran it (`EngineSettings`): its dtype's bytes per value,
the training FLOPs its remat and KL settings cost, dense static-shape attention and one dispatch per
rollout (`locojax.rollout`'s single `while_loop`); a profile's own defaults describe the serving-style
engines of the paper's comparison instead. A run's model is the one it trained: the dimensions its
`environment.json` records (a checkpoint's own), else its spec's preset.
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
from locojax.contract import METRICS_FILE, SPEC_FILE, EngineEnvironment, read_environment
from locojax.model.config import PRESETS, LoRAConfig, ModelConfig
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
from locojax.placement.memory import spec_lora_config
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
    environment: EngineEnvironment | None = None  # environment.json, where the run wrote one

    @classmethod
    def from_records(cls, spec: RunSpec | Mapping[str, Any], records: Iterable[Mapping[str, Any]],
                     source: str = "records", environment: EngineEnvironment | None = None) -> "MeasuredRun":
        if not isinstance(spec, RunSpec):
            spec = parse_spec(dict(spec))
        return cls(spec=spec, records=tuple(records), source=source, environment=environment)


def load_run(run_dir: str | Path) -> MeasuredRun:
    """A run directory written by the engine: `spec.yaml`, `metrics.jsonl` and (since issue 41)
    `environment.json`. Every error names the file (and line) at fault."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory")
    if not (run_dir / SPEC_FILE).is_file():
        raise ValueError(f"{run_dir / SPEC_FILE}: not found")
    spec = load_spec(run_dir / SPEC_FILE)
    environment = read_environment(run_dir)
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
    return MeasuredRun(spec=spec, records=tuple(records), source=str(run_dir), environment=environment)


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """Median per-step times of a run (NaN where the records do not have the metric)."""

    step_s: float
    device_s: float
    host_s: float
    network_s: float
    steps: int
    completion_len_mean: float | None = None
    rollout_s: float = math.nan
    reward_s: float = math.nan
    train_s: float = math.nan

    def to_json(self) -> dict[str, Any]:
        """JSON has no NaN: a metric the run did not report is null."""
        return {key: (None if isinstance(value, float) and math.isnan(value) else value)
                for key, value in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "measured") -> "StepMeasurement":
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            value = data.get(field.name)
            if field.name == "steps":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{where}.steps: a positive whole number is required, got {value!r}")
                values["steps"] = value
            elif value is None:
                if field.name == "step_s":
                    raise ValueError(f"{where}.step_s: required")
                values[field.name] = None if field.name == "completion_len_mean" else math.nan
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (field.name == "step_s" and value <= 0):
                raise ValueError(f"{where}.{field.name}: a finite non-negative number is required, got {value!r}")
            else:
                values[field.name] = float(value)
        return cls(**values)


_METRIC_KEYS = {"step_s": c.TIME_STEP, "device_s": c.TIME_DEVICE, "host_s": c.TIME_HOST, "network_s": c.TIME_NETWORK,
                "rollout_s": c.TIME_ROLLOUT, "reward_s": c.TIME_REWARD, "train_s": c.TIME_TRAIN}


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
    return StepMeasurement(steps=len(per_step(c.TIME_STEP)),
                           completion_len_mean=statistics.median(lengths) if lengths else None, **medians)


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
class EngineSettings:
    """What this engine does, for one spec, that a hardware profile's defaults do not say: it decodes
    with dense static-shape attention in one dispatch per rollout, holds weights and cache in the
    spec's dtype, and trains at 6 FLOPs per parameter-token (forward and backward; the behaviour
    policy's log-probs come from the rollout), plus 2 to recompute each layer (`model.remat: full`;
    `dots` keeps the matmul outputs and recomputes no matmul of the weights) and
    2 for the reference model's forward pass (`algo.kl_coef > 0`), times `algo.num_iterations` updates."""

    bytes_per_value: int
    train_flops_per_param_token: float

    def apply(self, hardware: HardwareProfile) -> HardwareProfile:
        return hardware.replace(bytes_per_value=self.bytes_per_value,
                                train_flops_per_param_token=self.train_flops_per_param_token,
                                decode_attention="dense", decode_tokens_per_dispatch=None)


def engine_settings(spec: RunSpec) -> EngineSettings:
    flops = 6.0 + (2.0 if spec.model.remat == "full" else 0.0) + (2.0 if spec.algo.kl_coef > 0 else 0.0)
    return EngineSettings(bytes_per_value=2 if spec.model.dtype == "bfloat16" else 4,
                          train_flops_per_param_token=flops * spec.algo.num_iterations)


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
    engine: EngineSettings | None = None  # None: the profile's own defaults

    def predict(self, hardware: HardwareProfile) -> StepEstimate:
        if self.engine is not None:
            hardware = self.engine.apply(hardware)
        if self.device_time_scale != 1.0:
            hardware = hardware.replace(device_time_scale=hardware.device_time_scale * self.device_time_scale)
        return estimate_step(self.model, hardware, self.workload, self.placement)


def model_config_from_json(fields: Mapping[str, Any], where: str = "model") -> ModelConfig:
    """A ModelConfig from its recorded fields (`environment.json`'s `model`), each error naming `where`."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"{where}: expected an object of ModelConfig fields")
    known = {field.name for field in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    try:
        fields = dict(fields)
        if isinstance(fields.get("lora"), Mapping):  # recorded as an object (dataclasses.asdict)
            lora = dict(fields["lora"])
            fields["lora"] = LoRAConfig(**{**lora, "targets": tuple(lora.get("targets", ()))})
        return ModelConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def run_model_config(spec: RunSpec, environment: EngineEnvironment | None, where: str = "run") -> ModelConfig:
    """The model a run trained: what its environment.json recorded, else its spec's preset. A spec that
    starts from a checkpoint names a preset that need not be the checkpoint's size, so without the
    recorded dimensions it is refused."""
    if environment is not None:
        return model_config_from_json(environment.model, f"{where}: environment.json model")
    if spec.model.checkpoint:
        raise ValueError(f"{where}: the spec starts from model.checkpoint {spec.model.checkpoint!r} and the run "
                         "recorded no environment.json, so the model's dimensions are unknown")
    return PRESETS[spec.model.preset].replace(lora=spec_lora_config(spec))


def observation_from(spec: RunSpec, model: ModelConfig, measured: StepMeasurement, label: str = "") -> Observation:
    """The observation of a run of `spec` that trained `model` and measured `measured`."""
    return Observation(model=ModelSize.from_config(model), workload=workload_for_spec(spec, measured.completion_len_mean),
                       placement=placement_for_spec(spec), measured=measured, label=label, engine=engine_settings(spec))


def observation_for_run(run: MeasuredRun, skip_steps: int = DEFAULT_SKIP_STEPS, *,
                        require_model_dims: bool = False) -> Observation:
    """`require_model_dims`: refuse a checkpoint-started run without environment.json instead of pricing
    its spec's preset (imports); in-memory records of a known preset (the benchmarks) need not."""
    measured = summarize(run.records, skip_steps)
    spec = run.spec
    if require_model_dims or run.environment is not None:
        model = run_model_config(spec, run.environment, run.source)
    else:
        model = PRESETS[spec.model.preset].replace(lora=spec_lora_config(spec))
    return observation_from(spec, model, measured, label=run.source)


@dataclasses.dataclass(frozen=True)
class FitError:
    """Root-mean-square error over runs, each as a fraction of the run's measured step time (`phases`:
    of the rollout, reward and train phases, where the runs measured them and the mode times them as the
    model counts them)."""

    step: float
    host: float
    network: float
    phases: float = math.nan


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
    profile: HardwareProfile
    constants: dict[str, float]  # fitted values, by the cost model's constant names
    before: FitError
    after: FitError
    observations: int

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile.to_json(), "constants": self.constants,
                "fit_error_before": _finite(dataclasses.asdict(self.before)),
                "fit_error_after": _finite(dataclasses.asdict(self.after)), "observations": self.observations}


def _finite(values: Mapping[str, float]) -> dict[str, float | None]:
    return {key: (None if isinstance(value, float) and not math.isfinite(value) else value)
            for key, value in values.items()}


# An engine phase (`time/rollout`, ...) against the cost model's breakdown entries that make it up: the
# engine times the train step with its fused gradient all-reduce.
PHASE_BREAKDOWN = {"rollout_s": ("rollout",), "reward_s": ("reward",), "train_s": ("train", "allreduce")}


def predicted_phases(estimate: StepEstimate) -> dict[str, float]:
    """The predicted time of each engine phase (`PHASE_BREAKDOWN`), by the measured field's name."""
    return {field: sum(estimate.breakdown.get(name, 0.0) for name in names)
            for field, names in PHASE_BREAKDOWN.items()}


def _phase_errors(obs: Observation, predicted: StepEstimate) -> list[float]:
    if not MODE_COSTS.get(obs.placement.mode).split_comparable:
        return []
    phases = predicted_phases(predicted)
    return [(phases[field] - getattr(obs.measured, field)) / obs.measured.step_s
            for field in PHASE_BREAKDOWN if not math.isnan(getattr(obs.measured, field))]


def fit_error(hardware: HardwareProfile, observations: Sequence[Observation]) -> FitError:
    errors: dict[str, list[float]] = {"step": [], "host": [], "network": [], "phases": []}
    for obs in observations:
        predicted = obs.predict(hardware)
        scale = obs.measured.step_s
        for name, pred, meas in (("step", predicted.step_s, obs.measured.step_s),
                                 ("host", predicted.host_s, obs.measured.host_s),
                                 ("network", predicted.network_s, obs.measured.network_s)):
            if not math.isnan(meas):
                errors[name].append((pred - meas) / scale)
        errors["phases"].extend(_phase_errors(obs, predicted))

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


@dataclasses.dataclass(frozen=True)
class DeviceConstant:
    """An accelerator's device constant that observations refit: the value it starts from when the
    profile holds 0 (a log-scale fit needs a scale), and the factor of its starting value it may not
    exceed (None: unbounded): an MFU is at most 1, decode reads HBM at most at the datasheet rate."""

    floor: float
    at_most: float | None = None  # absolute upper bound
    at_most_start: bool = False  # the profile's own value is the upper bound
    # A cost that scales with one model dimension beside the matmuls ("vocab_size": per vocabulary
    # entry; "n_layers": per decoder layer): fitted only from runs where that dimension takes more than
    # one value. At one vocabulary size a per-entry cost is a fixed cost per sequence or scored slot in
    # disguise, which the fit trades against the matmul rate and the other per-slot costs, and which a
    # model of another vocabulary then multiplies by the ratio of the sizes: on round 2's six runs, all
    # at 384 entries, a fitted training term took 5.9e-10 s and moved train_mfu / mfu_reference_width
    # from 0.84 / 359 to 0.98 / 256 at the same fit error, a choice the runs cannot make and 151,936
    # entries magnify 400x. A per-layer cost at one depth likewise. Otherwise it keeps the profile's value.
    varies_with: str | None = None
    start: float | None = None  # where the fit starts when the profile holds 0 (default: the floor)


DEVICE_CONSTANTS: dict[str, DeviceConstant] = {
    "train_mfu": DeviceConstant(floor=1e-3, at_most=1.0),
    # How MFU falls with narrower models (`effective_mfu`): runs of one width cannot tell it from the
    # MFU, runs of two can.
    "mfu_reference_width": DeviceConstant(floor=1.0),
    "train_step_overhead_s": DeviceConstant(floor=1e-4),
    "decode_layer_overhead_s": DeviceConstant(floor=1e-6),
    "decode_vocab_overhead_s": DeviceConstant(floor=1e-12, varies_with="vocab_size"),
    # The log-softmax over a scored slot's vocabulary in training: like decode's sampling, told apart
    # only by runs at two vocabulary sizes (bench/tpu.sh's placement-runs include the real one).
    "train_vocab_overhead_s": DeviceConstant(floor=1e-12, varies_with="vocab_size"),
    # The elementwise passes over each layer's activations in training: told from the per-token and
    # matmul costs only by runs of two depths (placement-runs include 12-layer ones). It starts from
    # ~10 bf16 passes per activation element at the v5e's datasheet bandwidth (2e-11 s).
    "train_layer_activation_s": DeviceConstant(floor=1e-14, varies_with="n_layers", start=2e-11),
    "hbm_bandwidth": DeviceConstant(floor=1e9, at_most_start=True),
}


@dataclasses.dataclass(frozen=True)
class FitRecipe:
    """What one hardware profile's calibration refits besides the host and network constants."""

    device_constants: tuple[str, ...]  # DEVICE_CONSTANTS names
    fit_device_scale: bool  # one factor on every device time (`device_time_scale`)
    phases: bool  # fit each run's measured phases too, not only its step and split


def recipe_for(hardware: HardwareProfile) -> FitRecipe:
    """The local CPU's device rates come from its probe (runs refit how fast the machine ran them); an
    accelerator's come from datasheets and assumptions, so its observations refit them."""
    if hardware.shared_machine:
        return FitRecipe(device_constants=(), fit_device_scale=True, phases=False)
    return FitRecipe(device_constants=tuple(DEVICE_CONSTANTS), fit_device_scale=False, phases=True)


def _fitted_names(hardware: HardwareProfile, observations: Sequence[Observation]) -> list[str]:
    """The host and network constants some observation's critical path counts (the others cannot be
    told from these runs and keep their values)."""
    used: set[str] = set()
    for obs in observations:
        path = obs.predict(hardware).critical_path
        used |= {name for name, count in {**path.host, **path.network}.items() if count}
    return [name for name in (*HOST_CONSTANTS, *NETWORK_CONSTANTS) if name in used]


def _fitted_device_names(recipe: FitRecipe, observations: Sequence[Observation]) -> list[str]:
    """The recipe's device constants these runs can tell apart: a cost per vocabulary entry or per
    layer only where the runs hold more than one vocabulary size or depth (`DeviceConstant.varies_with`)."""
    def told_apart(constant: DeviceConstant) -> bool:
        return constant.varies_with is None or len(
            {getattr(obs.model, constant.varies_with) for obs in observations}) > 1
    return [name for name in recipe.device_constants if told_apart(DEVICE_CONSTANTS[name])]


def _residuals(hardware: HardwareProfile, observations: Sequence[Observation], phases: bool = False) -> list[float]:
    """Each run's step, host and network error (and with `phases`, its phases' errors) as a fraction of
    its measured step. The host/network split and the phases are compared only where the engine times
    them as the model counts them (`ModeCost.split_comparable`)."""
    out = []
    for obs in observations:
        measured = obs.measured
        predicted = obs.predict(hardware)
        out.append((predicted.step_s - measured.step_s) / measured.step_s)
        if MODE_COSTS.get(obs.placement.mode).split_comparable:
            for pred, meas in ((predicted.host_s, measured.host_s), (predicted.network_s, measured.network_s)):
                if not math.isnan(meas):
                    out.append((pred - meas) / measured.step_s)
        if phases:
            out.extend(_phase_errors(obs, predicted))
    return out


def calibrate(hardware: HardwareProfile, observations: Sequence[Observation],
              regularization: float = DEFAULT_REGULARIZATION, fit_device_scale: bool | None = None,
              recipe: FitRecipe | None = None) -> CalibrationResult:
    """Refit `hardware`'s constants to the observations and report the fit error: its host and network
    constants, and what the profile's `FitRecipe` adds (`recipe_for`; `fit_device_scale` overrides
    its choice): for the local CPU, how fast the devices ran relative to the probe's rates
    (`device_time_scale`: a probe times kernels in isolation, minutes or hours away from the runs, and
    this machine's speed drifts by tens of % over that); for accelerators, the device constants (those
    per vocabulary entry or per layer only where the runs hold two vocabulary sizes or depths:
    `_fitted_device_names`).

    One nonlinear least squares over the log of each value's multiplier, on every run's step, host and
    network error (`_residuals`), with a weak pull towards the current values. The counts themselves
    depend on the constants (which DA branch is critical, how much reward decode hides), so fitting
    the counts at fixed constants, over and over, need not settle: on the coordination benchmark's runs
    it flipped between two solutions on every pass."""
    from scipy.optimize import least_squares

    if not observations:
        raise ValueError("calibration needs at least one measured run")
    recipe = recipe or recipe_for(hardware)
    if fit_device_scale is not None:
        recipe = dataclasses.replace(recipe, fit_device_scale=fit_device_scale)
    before = fit_error(hardware, observations)
    current = constant_values(hardware)
    start = {name: max(current[name], _FLOOR.get(name, 1e-9)) for name in _fitted_names(hardware, observations)}
    upper: dict[str, float] = {}
    ceiling: dict[str, float] = {}  # the values themselves, which the log-scale bound meets only to rounding
    for name in _fitted_device_names(recipe, observations):
        constant = DEVICE_CONSTANTS[name]
        start[name] = max(getattr(hardware, name) or (constant.start or 0.0), constant.floor)
        if constant.at_most is not None:
            upper[name] = math.log(constant.at_most / start[name])
            ceiling[name] = constant.at_most
        elif constant.at_most_start:
            upper[name] = 0.0
            ceiling[name] = start[name]
    if recipe.fit_device_scale:
        start["device_time_scale"] = hardware.device_time_scale
    names = list(start)

    def values_at(log_multipliers: np.ndarray) -> dict[str, float]:
        return {name: min(start[name] * math.exp(x), ceiling.get(name, math.inf))
                for name, x in zip(names, log_multipliers)}

    def profile(log_multipliers: np.ndarray) -> HardwareProfile:
        values = values_at(log_multipliers)
        scale = values.pop("device_time_scale", hardware.device_time_scale)
        return with_constants(hardware, values).replace(device_time_scale=scale)

    pull = math.sqrt(regularization)

    def objective(x: np.ndarray) -> np.ndarray:
        return np.concatenate([_residuals(profile(x), observations, recipe.phases), pull * x])

    low = np.full(len(names), -25.0)
    high = np.array([max(upper.get(name, 25.0), 1e-9) for name in names])
    fit = least_squares(objective, np.zeros(len(names)), bounds=(low, high))
    fitted = profile(fit.x)
    constants = values_at(fit.x)
    return CalibrationResult(profile=fitted, constants=constants, before=before,
                             after=fit_error(fitted, observations), observations=len(observations))


def calibrate_runs(hardware: HardwareProfile, runs: Sequence[MeasuredRun | str | Path],
                   skip_steps: int = DEFAULT_SKIP_STEPS,
                   regularization: float = DEFAULT_REGULARIZATION) -> CalibrationResult:
    """Calibrate from run directories and/or `MeasuredRun`s (records fed directly)."""
    loaded = [run if isinstance(run, MeasuredRun) else load_run(run) for run in runs]
    return calibrate(hardware, [observation_for_run(run, skip_steps) for run in loaded], regularization)


# --- observations as data: what `locojax calibration import` sends and the control plane stores --------

# Steady steps (after warm-up) a run must have measured to teach the model: one for a run that finished
# every step, three for one that failed or was cancelled (fewer medians of a broken run are noise).
MIN_STEADY_STEPS_FINISHED = 1
MIN_STEADY_STEPS_UNFINISHED = 3
# Run kinds the GRPO step model prices (an SFT warm start is another workload).
PRICED_KINDS = ("grpo",)


def steady_steps_refusal(spec: RunSpec, measured: StepMeasurement, finished: bool) -> str | None:
    """Why a run teaches the model nothing, or None: a kind it does not price, or too few steady steps."""
    if spec.kind not in PRICED_KINDS:
        return f"a {spec.kind} run is not a GRPO step the cost model prices"
    needed = MIN_STEADY_STEPS_FINISHED if finished else MIN_STEADY_STEPS_UNFINISHED
    if measured.steps < needed:
        state = "a finished run" if finished else "a run that did not finish"
        return f"{measured.steps} steady step(s) after warm-up; {state} needs at least {needed}"
    return None


def run_digest(run_dir: str | Path) -> str:
    """What identifies a run directory wherever it is copied to: the SHA-256 of its spec, metrics and
    environment files (importing the same run twice is one observation)."""
    import hashlib

    digest = hashlib.sha256()
    for name in (SPEC_FILE, METRICS_FILE, c.ENVIRONMENT_FILE):
        path = Path(run_dir) / name
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"")
        digest.update(b"\0")
    return digest.hexdigest()


def observation_payload(run_dir: str | Path, skip_steps: int = DEFAULT_SKIP_STEPS) -> dict[str, Any]:
    """The observation a `locojax train` run directory makes, as the JSON the control plane's import
    route takes (`POST /api/v1/calibration/observations`) and `bench/placement_tpu.py` reads offline.

    The hardware is the catalog profile the engine recorded in `environment.json` (a directory without
    one predates it and is refused: what it ran on is unknown); the model is the one it trained. A run
    counts when it finished (`result.json` status succeeded) with a steady step, or otherwise with
    `MIN_STEADY_STEPS_UNFINISHED`. Errors name the directory and the file or field at fault."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    if run.environment is None:
        raise ValueError(f"{run_dir / c.ENVIRONMENT_FILE}: not found; the engine writes it since issue 41, and "
                         "without it the hardware the run measured is unknown")
    environment = run.environment
    if environment.hardware is None:
        raise ValueError(f"{run_dir / c.ENVIRONMENT_FILE}: device kind {environment.device_kind!r} "
                         f"({environment.platform}) is not in the hardware catalog")
    model = run_model_config(run.spec, environment, str(run_dir))
    try:
        measured = summarize(run.records, skip_steps)
    except ValueError as exc:
        raise ValueError(f"{run_dir / METRICS_FILE}: {exc}") from None
    result = c.read_result(run_dir)
    finished = result is not None and result.status == c.EngineStatus.SUCCEEDED.value
    refusal = steady_steps_refusal(run.spec, measured, finished)
    if refusal is not None:
        raise ValueError(f"{run_dir}: {refusal}")
    return {"label": run_dir.resolve().name, "digest": run_digest(run_dir), "hardware": environment.hardware,
            "device_kind": environment.device_kind, "device_count": environment.devices, "finished": finished,
            "spec": run.spec.model_dump(mode="json"), "model": dataclasses.asdict(model),
            "measured": measured.to_json()}


def observation_from_payload(payload: Mapping[str, Any], where: str = "observation") -> Observation:
    """The Observation an `observation_payload` (or a stored one) describes; errors name the field."""
    try:
        spec = parse_spec(dict(payload["spec"]), f"{where}.spec")
    except KeyError as exc:
        raise ValueError(f"{where}.{exc.args[0]}: required") from None
    model = model_config_from_json(payload.get("model"), f"{where}.model")
    measured = StepMeasurement.from_json(payload.get("measured") or {}, f"{where}.measured")
    return observation_from(spec, model, measured, label=str(payload.get("label", "")))
