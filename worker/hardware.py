"""What this host's devices are, found once at worker start: the worker never imports JAX itself, so
it asks JAX in a short-lived child process (`python -c PROBE`), before any engine process exists (one
process at a time can hold a TPU, and the child has exited before the worker takes work).

JAX's name for the devices (`Device.device_kind`, "TPU v5 lite") maps to the hardware catalog's
(`tpu-v5e`; any CPU is `local-cpu`) through `locojax.placement.hardware.hardware_for_device`, which is
what the host registers as its `device_kind`, with the device count and one device's memory. An
operator's `--device-kind` names the catalog profile instead (checked against the catalog) and skips
the probe, for a host whose devices JAX cannot open at start or a simulated host.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Mapping

# Run in the child: the first local device's platform, JAX name and memory, and how many there are.
PROBE = """
import json, jax
devices = jax.local_devices()
stats = devices[0].memory_stats() or {}
print(json.dumps({"platform": devices[0].platform, "device_kind": devices[0].device_kind,
                  "count": len(devices), "memory_bytes": stats.get("bytes_limit")}))
"""
PROBE_TIMEOUT_S = 300.0  # opening a TPU takes 10-15 s; a wedged runtime must not hang the worker forever


class HardwareError(ValueError):
    """The host's hardware could not be found or named; the message says what to pass instead."""


@dataclasses.dataclass(frozen=True)
class HostHardware:
    hardware: str  # the catalog profile: what the host registers as its device_kind
    device_count: int
    device_memory_bytes: int | None
    jax_device_kind: str | None  # what JAX called them (None: named by the operator, not probed)

    def info(self) -> dict[str, object]:
        """What the host record's `info` keeps beside the catalog name."""
        return {"jax_device_kind": self.jax_device_kind} if self.jax_device_kind else {}


def probe_devices(env: Mapping[str, str] | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, object]:
    """JAX's view of this host's devices, from a child process that exits before this returns."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s,
                              env=dict(env) if env is not None else None, check=False)
    except subprocess.TimeoutExpired:
        raise HardwareError(f"asking JAX for this host's devices took over {timeout_s:g} s; "
                            "pass --device-kind and --devices") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise HardwareError(f"asking JAX for this host's devices failed (exit {done.returncode}): {tail}; "
                            "pass --device-kind and --devices")
    return json.loads(lines[-1])


def check_device_kind(name: str) -> str:
    from locojax.placement.hardware import HARDWARE

    if name not in HARDWARE:
        raise HardwareError(f"--device-kind: {name!r} is not a hardware profile; known: {', '.join(HARDWARE.names())}")
    return name


def host_hardware(device_kind: str | None, devices: int | None, *, env: Mapping[str, str] | None = None,
                  probe=probe_devices) -> HostHardware:
    """The hardware this host registers: the operator's `--device-kind` (and `--devices`, default 1), or
    what JAX finds (`--devices` still overrides the count: simulated CPU hosts)."""
    from locojax.placement.hardware import hardware_for_device

    if device_kind is not None:
        return HostHardware(check_device_kind(device_kind), devices or 1, None, None)
    found = probe(env)
    hardware = hardware_for_device(str(found["device_kind"]), str(found["platform"]))
    if hardware is None:
        raise HardwareError(f"JAX reports {found['device_kind']!r} ({found['platform']}), which no hardware profile "
                            "describes; pass --device-kind with the nearest profile")
    memory = found.get("memory_bytes")
    return HostHardware(hardware, devices or int(found["count"]), int(memory) if memory else None,
                        str(found["device_kind"]))
