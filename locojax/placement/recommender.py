"""The placement recommender: which mode, how many hosts, and what share of them doing rollout.

`recommend(PlacementRequest)` searches mode (SC, CO, DA) x host count (powers of two up to the chip
budget, and the budget itself) x DA rollout fraction (1/4 ... 7/8 in eighths), predicts every option
with the cost model, ranks them by step time and explains the winner in one sentence with numbers.
The request and the answer are pydantic models: they are what the REST API stores as a placement
decision.
"""

from __future__ import annotations

from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from locojax.model.config import PRESETS
from locojax.placement.cost_model import (
    MODE_COSTS,
    InfeasiblePlacement,
    ModelSize,
    Placement,
    StepEstimate,
    estimate_step,
)
from locojax.placement.hardware import HARDWARE, HardwareProfile
from locojax.placement.memory import GiB, MemoryPlan, MemoryPlanError, fit_plan
from locojax.placement.workloads import WORKLOADS, WorkloadProfile
from locojax.registry import Registry

# DA rollout fractions searched: quarter to seven eighths of the hosts.
ROLLOUT_FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)
# Options within this relative step time of each other count as a tie; the one with fewer chips wins.
TIE_TOLERANCE = 0.01


class PlacementRequest(BaseModel):
    """What a user asks before a run: this model, on this hardware, with this many chips, for this workload."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(..., max_length=64, description="a preset name from locojax.model.PRESETS")
    hardware: str = Field(..., max_length=64, description="a hardware profile name")
    chips: int = Field(..., ge=1, le=65536, description="chip budget")
    chips_per_host: int | None = Field(None, ge=1, le=64, description="default: the hardware profile's")
    workload: str = Field(..., max_length=64, description="a workload profile name")
    prompts_per_step: int | None = Field(None, ge=1, le=1_000_000)
    group_size: int | None = Field(None, ge=1, le=4096)
    prompt_len: int | None = Field(None, ge=1, le=1_000_000)
    gen_len: int | None = Field(None, ge=1, le=1_000_000)

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value.lower() not in PRESETS:
            raise ValueError(f"unknown model {value!r}; known: {', '.join(PRESETS)}")
        return value.lower()

    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, value: str) -> str:
        if value not in HARDWARE:
            raise ValueError(f"unknown hardware {value!r}; known: {', '.join(HARDWARE.names())}")
        return value

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str) -> str:
        if value not in WORKLOADS:
            raise ValueError(f"unknown workload {value!r}; known: {', '.join(WORKLOADS.names())}")
        return value

    @model_validator(mode="after")
    def _chips_fill_hosts(self) -> "PlacementRequest":
        per_host = self.resolved_chips_per_host
        if self.chips % per_host:
            raise ValueError(f"chips ({self.chips}) must be divisible by chips_per_host ({per_host})")
        return self

    @property
    def resolved_chips_per_host(self) -> int:
        return self.chips_per_host or HARDWARE.get(self.hardware).chips_per_host

    def workload_profile(self) -> WorkloadProfile:
        """The named workload with this request's overrides applied."""
        overrides = {name: getattr(self, name) for name in ("prompts_per_step", "group_size", "prompt_len", "gen_len")
                     if getattr(self, name) is not None}
        return WORKLOADS.get(self.workload).replace(**overrides)


class PlacementOption(BaseModel):
    model_config = ConfigDict(frozen=True)

    mode: Literal["sc", "co", "da"]
    chips: int
    hosts: int
    rollout_fraction: float | None
    step_time_s: float
    device_s: float
    host_s: float
    network_s: float
    breakdown: dict[str, float]  # seconds per phase; sums to step_time_s (DA overlap enters negatively)
    # The per-host training mesh, dtype and remat policy the memory plan fits HBM with (RunSpec
    # placement.fsdp/tensor, model.dtype, model.remat), and that plan's peak per chip.
    fsdp: int = 1
    tensor: int = 1
    dtype: str = "float32"
    remat: str = "none"
    memory_per_chip_gib: float | None = None

    @classmethod
    def from_estimate(cls, estimate: StepEstimate, plan: MemoryPlan | None = None) -> "PlacementOption":
        placement = estimate.placement
        memory = {} if plan is None else dict(
            fsdp=plan.mesh.fsdp, tensor=plan.mesh.tensor, dtype=plan.dtype, remat=plan.remat,
            memory_per_chip_gib=plan.peak_bytes / GiB)
        return cls(mode=placement.mode, chips=placement.chips, hosts=placement.hosts,
                   rollout_fraction=placement.rollout_fraction, step_time_s=estimate.step_s,
                   device_s=estimate.device_s, host_s=estimate.host_s, network_s=estimate.network_s,
                   breakdown=dict(estimate.breakdown), **memory)

    @property
    def label(self) -> str:
        mode = MODE_COSTS.get(self.mode).label(self.rollout_fraction, suffix=" rollout,")
        return f"{mode} {self.chips} chips"


class Recommendation(BaseModel):
    model_config = ConfigDict(frozen=True)

    request: PlacementRequest
    options: list[PlacementOption]  # ranked, best first
    choice: PlacementOption
    reason: str  # one sentence with the numbers behind the choice
    memory: str = ""  # the choice's memory plan per chip (locojax.placement.memory), one line


def candidate_placements(chips: int, chips_per_host: int) -> list[Placement]:
    """Every placement the recommender weighs within a budget of `chips`."""
    budget_hosts = chips // chips_per_host
    host_counts = sorted({2 ** power for power in range(budget_hosts.bit_length()) if 2 ** power <= budget_hosts}
                         | {budget_hosts})
    placements: list[Placement] = []
    for hosts in host_counts:
        used = hosts * chips_per_host
        for mode in MODE_COSTS:
            if not MODE_COSTS.get(mode).rollout_groups:
                placements.append(Placement(mode, used, chips_per_host))
                continue
            # A mode with rollout and train groups: one option per distinct rollout host count.
            seen_rollout_hosts: set[int] = set()
            for fraction in ROLLOUT_FRACTIONS:
                rollout_hosts = round(hosts * fraction)
                if not 1 <= rollout_hosts <= hosts - 1 or rollout_hosts in seen_rollout_hosts:
                    continue
                seen_rollout_hosts.add(rollout_hosts)
                placements.append(Placement(mode, used, chips_per_host, fraction))
    return placements


def rank_estimates(model: ModelSize, hardware: HardwareProfile, workload: WorkloadProfile,
                   placements: list[Placement]) -> list[StepEstimate]:
    """Feasible placements, fastest first; near-ties go to fewer chips, then to the simpler mode."""
    estimates: list[StepEstimate] = []
    for placement in placements:
        try:
            estimates.append(estimate_step(model, hardware, workload, placement))
        except InfeasiblePlacement:
            continue
    def tie_rank(estimate: StepEstimate) -> int:
        return MODE_COSTS.get(estimate.placement.mode).tie_rank

    estimates.sort(key=lambda e: (e.step_s, e.placement.chips, tie_rank(e)))
    if not estimates:
        return estimates
    best = estimates[0].step_s
    near = [e for e in estimates if e.step_s <= best * (1 + TIE_TOLERANCE)]
    winner = min(near, key=lambda e: (e.placement.chips, tie_rank(e), e.step_s))
    estimates.remove(winner)
    return [winner, *estimates]


def recommend(request: PlacementRequest, hardware_profile: HardwareProfile | None = None) -> Recommendation:
    """Rank every placement within the request's chip budget and explain the best one.

    `hardware_profile` replaces the registered profile of the same name (a probed `local-cpu`, or a
    calibrated one); the engine never reads such files on its own.
    """
    hardware = hardware_profile or HARDWARE.get(request.hardware)
    if hardware.name != request.hardware:
        raise ValueError(f"hardware_profile {hardware.name!r} does not match request.hardware {request.hardware!r}")
    workload = request.workload_profile()
    model = ModelSize.from_config(PRESETS[request.model])
    chips_per_host = request.resolved_chips_per_host
    estimates = rank_estimates(model, hardware, workload, candidate_placements(request.chips, chips_per_host))
    if not estimates:
        raise ValueError(f"model {request.model!r} does not fit {request.chips} {hardware.name} chip(s) "
                         f"with workload {request.workload!r}; ask for more chips")
    # Only placements whose memory plan fits HBM are recommended; the first option must be one.
    plans: list[MemoryPlan | None] = []
    refusal = None
    for estimate in estimates:
        try:
            plans.append(memory_plan(request, hardware, workload, estimate.placement))
        except MemoryPlanError as exc:
            plans.append(None)
            refusal = refusal or exc
    fitting = [(e, p) for e, p in zip(estimates, plans) if p is not None]
    if not fitting:
        raise MemoryPlanError(f"no placement of {request.model!r} within {request.chips} {hardware.name} chip(s) "
                              f"fits HBM: {refusal}")
    estimates = [e for e, _ in fitting]
    options = [PlacementOption.from_estimate(e, p) for e, p in fitting]
    return Recommendation(request=request, options=options, choice=options[0],
                          reason=explain(estimates, request.chips), memory=fitting[0][1].summary())


def memory_plan(request: PlacementRequest, hardware: HardwareProfile, workload: WorkloadProfile,
                placement: Placement) -> MemoryPlan:
    """The first plan that fits one chip's HBM for `placement`: a host's training rows are the step's
    samples over the hosts that train; its chips shard the model as little as fits (fsdp before
    tensor), remat before bfloat16 (on profiles that run bfloat16 at all)."""
    rows_per_host = -(-workload.samples // placement.train_hosts)
    dtypes = ("float32", "bfloat16") if hardware.bytes_per_value == 2 else ("float32",)
    return fit_plan(PRESETS[request.model], devices_per_host=placement.chips_per_host,
                    capacity_bytes=hardware.hbm_bytes, capacity_name=f"{hardware.name} HBM", dtypes=dtypes,
                    rows_per_host=rows_per_host, prompt_len=workload.prompt_len, new_len=workload.gen_len)


def _best(estimates: list[StepEstimate], mode: str, chips: int | None = None) -> StepEstimate | None:
    matching = [e for e in estimates if e.placement.mode == mode and (chips is None or e.placement.chips == chips)]
    return min(matching, key=lambda e: e.step_s, default=None)


def explain(estimates: list[StepEstimate], chip_budget: int) -> str:
    """One sentence with numbers: why the first estimate beats the alternatives."""
    choice = estimates[0]
    chips = choice.placement.chips
    best = {mode: _best(estimates, mode, chips) for mode in MODE_COSTS}
    bound = "memory-bound" if choice.rollout_memory_bound else "compute-bound"
    fewer = (f"; more than {chips} of the {chip_budget} chips does not help"
             if chips < chip_budget else "")
    return WHY_IT_WINS.get(choice.placement.mode)(choice, best, bound, fewer)


Explanation = Callable[[StepEstimate, dict[str, StepEstimate | None], str, str], str]
# Per winning mode: the sentence that says why it wins (choice, best estimate per mode, bound, fewer).
WHY_IT_WINS: Registry[Explanation] = Registry("placement explanation")


@WHY_IT_WINS.register("da")
def _why_da(choice: StepEstimate, best: dict[str, StepEstimate | None], bound: str, fewer: str) -> str:
    co = best["co"]
    if co is None:
        return _why_sc(choice, best, bound, fewer)
    saving = 1 - choice.step_s / co.step_s
    return (f"rollout is {co.rollout_share:.0%} of the CO step and {bound}; giving it "
            f"{choice.placement.rollout_fraction:.0%} of the {choice.placement.hosts} hosts overlaps training "
            f"and saves {saving:.0%} ({choice.step_s:.3g} s vs {co.step_s:.3g} s per step){fewer}.")


@WHY_IT_WINS.register("co")
def _why_co(choice: StepEstimate, best: dict[str, StepEstimate | None], bound: str, fewer: str) -> str:
    chips, da, sc = choice.placement.chips, best["da"], best["sc"]
    parts = [f"CO on {chips} chip{'s' if chips != 1 else ''} is fastest at {choice.step_s:.3g} s per step: rollout is "
             f"{choice.rollout_share:.0%} of the step and {bound}"]
    if da is not None and da.step_s > choice.step_s:
        parts.append(f"the best DA split ({da.placement.rollout_fraction:.0%} rollout hosts) is "
                     f"{da.step_s / choice.step_s - 1:.0%} slower because dividing the chips and pushing "
                     f"weights costs more than the overlap hides")
    elif da is not None:
        parts.append(f"DA ({da.placement.rollout_fraction:.0%} rollout hosts) is within "
                     f"{TIE_TOLERANCE:.0%}, not worth a second process group")
    if sc is not None:
        ratio = sc.step_s / choice.step_s
        slower = f"{ratio:.2g}x slower" if ratio >= 1.1 else f"only {ratio - 1:.0%} slower"
        parts.append(f"the single controller is {slower} ({sc.host_s / sc.step_s:.0%} of its step is host "
                     f"orchestration)")
    return "; ".join(parts) + fewer + "."


@WHY_IT_WINS.register("sc")
def _why_sc(choice: StepEstimate, best: dict[str, StepEstimate | None], bound: str, fewer: str) -> str:
    # SC wins only when orchestration is cheap relative to the device work (large models).
    co = best["co"]
    versus = f", {co.step_s / choice.step_s - 1:.1%} ahead of CO" if co is not None else ""
    return (f"the single controller is fastest at {choice.step_s:.3g} s per step{versus}: host orchestration "
            f"is only {choice.host_s / choice.step_s:.0%} of its step{fewer}.")
