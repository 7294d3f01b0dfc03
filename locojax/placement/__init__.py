"""Placement: which coordination mode (SC, CO, DA), how many hosts and what rollout share, and why.

Public API (the REST API and the CLI use these names):
  * `PlacementRequest`, `PlacementOption`, `Recommendation`, `recommend` — the recommender;
  * `HARDWARE`, `HardwareProfile`, `get_hardware`, `load_local_cpu_profile` — hardware profiles;
  * `WORKLOADS`, `WorkloadProfile`, `get_workload` — workload profiles (models are `locojax.model.PRESETS`);
  * `Placement`, `StepEstimate`, `estimate_step` — the step-time cost model;
  * `calibrate`, `calibrate_runs`, `MeasuredRun`, `load_run` — refit constants from measured runs;
  * `run_sweep`, `write_sweep` — the characterization sweep (model size vs time split).
The calibration and sweep names load their modules (scipy, matplotlib) on first use.
"""

from locojax.placement.cost_model import InfeasiblePlacement, Placement, StepEstimate, estimate_step
from locojax.placement.hardware import HARDWARE, HardwareProfile, get_hardware, load_local_cpu_profile
from locojax.placement.recommender import PlacementOption, PlacementRequest, Recommendation, recommend
from locojax.placement.workloads import WORKLOADS, WorkloadProfile, get_workload

_LAZY = {
    "calibrate": "locojax.placement.calibration",
    "calibrate_runs": "locojax.placement.calibration",
    "CalibrationResult": "locojax.placement.calibration",
    "MeasuredRun": "locojax.placement.calibration",
    "load_run": "locojax.placement.calibration",
    "run_sweep": "locojax.placement.sweep",
    "write_sweep": "locojax.placement.sweep",
}

__all__ = [
    "HARDWARE", "HardwareProfile", "InfeasiblePlacement", "Placement", "PlacementOption", "PlacementRequest",
    "Recommendation", "StepEstimate", "WORKLOADS", "WorkloadProfile", "estimate_step", "get_hardware",
    "get_workload", "load_local_cpu_profile", "recommend", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'locojax.placement' has no attribute {name!r}")
