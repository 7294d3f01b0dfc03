"""The run's environment as its host 0 sees it at start: the devices JAX gives it, the catalog's hardware
profile they map to, and the dimensions of the model the spec trains (`environment.json`, the
contract's `EngineEnvironment`). The placement calibration prices a run directory from it without
JAX, the checkpoint or the machine it ran on (`locojax calibration import`).
"""

from __future__ import annotations

import dataclasses

import jax

from locojax.contract import EngineEnvironment
from locojax.placement.hardware import hardware_for_device
from locojax.placement.memory import spec_model_config
from locojax.spec import RunSpec


def device_memory_bytes(device: jax.Device) -> int | None:
    """The allocator's limit on one device, where the runtime reports one (accelerators; not XLA:CPU)."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def describe(spec: RunSpec) -> EngineEnvironment:
    device = jax.local_devices()[0]
    config = spec_model_config(spec)
    return EngineEnvironment(
        platform=device.platform, device_kind=device.device_kind,
        hardware=hardware_for_device(device.device_kind, device.platform), devices=jax.device_count(),
        local_devices=jax.local_device_count(), processes=jax.process_count(),
        device_memory_bytes=device_memory_bytes(device), model=dataclasses.asdict(config),
        jax_version=jax.__version__)
