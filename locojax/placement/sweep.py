"""The characterization sweep: how a step's time splits into device, host and network as models grow.

The paper's first figure: dense models from 0.6B to 405B under a decode-heavy workload, for the single
controller (SC) and for host-local coordination (CO). Each model runs on `chips` chips, or on the fewest
power-of-two chips that hold its training state when `chips` cannot (the JSON records which).
`write_sweep` saves the numbers as JSON and the figure as PNG.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from locojax.model.config import PRESETS
from locojax.placement.cost_model import InfeasiblePlacement, ModelSize, Placement, estimate_step
from locojax.placement.hardware import HardwareProfile
from locojax.placement.workloads import WorkloadProfile

SWEEP_MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
                "llama-3.1-70b", "llama-3.1-405b")
# GSM8K as profiled generates up to 512 tokens per 128-token prompt: decode-heavy.
DEFAULT_SWEEP_WORKLOAD = "gsm8k"
# Two 4-chip v7x hosts: the smallest multi-host placement.
DEFAULT_SWEEP_CHIPS = 8
MAX_CHIPS = 65536


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    model: str
    params: int
    chips: int
    mode: str
    step_s: float
    device_share: float
    host_share: float
    network_share: float
    breakdown: dict[str, float]


@dataclasses.dataclass(frozen=True)
class SweepResult:
    hardware: str
    workload: str
    points: tuple[SweepPoint, ...]

    def to_json(self) -> dict[str, Any]:
        return {"hardware": self.hardware, "workload": self.workload,
                "points": [dataclasses.asdict(point) for point in self.points]}

    def series(self, mode: str) -> list[SweepPoint]:
        return [point for point in self.points if point.mode == mode]


def fitting_chips(model: ModelSize, hardware: HardwareProfile, workload: WorkloadProfile, chips: int,
                  chips_per_host: int) -> int:
    """`chips`, doubled until the model fits colocated (CO and SC need the same memory)."""
    while chips <= MAX_CHIPS:
        try:
            estimate_step(model, hardware, workload, Placement("co", chips, chips_per_host))
            return chips
        except InfeasiblePlacement:
            chips *= 2
    raise ValueError(f"{model.name} does not fit {MAX_CHIPS} {hardware.name} chips")


def run_sweep(hardware: HardwareProfile, workload: WorkloadProfile, models: Sequence[str] = SWEEP_MODELS,
              chips: int = DEFAULT_SWEEP_CHIPS, modes: Sequence[str] = ("sc", "co")) -> SweepResult:
    chips_per_host = hardware.chips_per_host
    if chips % chips_per_host:
        raise ValueError(f"chips ({chips}) must be divisible by the profile's chips per host ({chips_per_host})")
    points = []
    for name in models:
        model = ModelSize.from_config(PRESETS[name])
        used = fitting_chips(model, hardware, workload, chips, chips_per_host)
        for mode in modes:
            estimate = estimate_step(model, hardware, workload, Placement(mode, used, chips_per_host))
            shares = estimate.shares
            points.append(SweepPoint(model=name, params=model.params, chips=used, mode=mode, step_s=estimate.step_s,
                                     device_share=shares["device"], host_share=shares["host"],
                                     network_share=shares["network"], breakdown=dict(estimate.breakdown)))
    return SweepResult(hardware=hardware.name, workload=workload.name, points=tuple(points))


def plot_sweep(result: SweepResult, path: Path) -> None:
    """Stacked device/host/network shares per model, one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({point.mode for point in result.points}, key=["sc", "co", "da"].index)
    figure, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), sharey=True, squeeze=False)
    colors = {"device": "#4c72b0", "host": "#dd8452", "network": "#55a868"}
    for axis, mode in zip(axes[0], modes):
        series = result.series(mode)
        labels = [f"{p.model}\n{p.params / 1e9:.1f}B, {p.chips} chips" for p in series]
        bottom = [0.0] * len(series)
        for part in ("device", "host", "network"):
            values = [getattr(p, f"{part}_share") for p in series]
            axis.bar(range(len(series)), values, bottom=bottom, color=colors[part], label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        axis.set_xticks(range(len(series)), labels, rotation=60, ha="right", fontsize=7)
        axis.set_title(f"{mode.upper()} on {result.hardware}, {result.workload}")
        axis.set_ylim(0, 1)
        axis.set_ylabel("share of step time")
    axes[0][0].legend(loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_sweep(result: SweepResult, out_dir: str | Path) -> tuple[Path, Path]:
    """Write `sweep-<hardware>.json` and `.png` into `out_dir`; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"sweep-{result.hardware}.json"
    png_path = out_dir / f"sweep-{result.hardware}.png"
    json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    plot_sweep(result, png_path)
    return json_path, png_path
