"""A worker finds its hardware at start by asking JAX in a child process, never importing JAX itself, and
names it by the hardware catalog; an operator's --device-kind is checked against the catalog."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.hardware import HardwareError, HostHardware, host_hardware

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_asks_jax_in_a_child_and_the_worker_stays_jax_free():
    code = ("import json, sys\n"
            "from worker.hardware import host_hardware\n"
            "found = host_hardware(None, None)\n"
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))\n"
            "print(json.dumps(found.__dict__))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # This machine has no accelerator: JAX's CPU device, which the catalog calls local-cpu.
    assert found == {"hardware": "local-cpu", "device_count": 1, "device_memory_bytes": None,
                     "jax_device_kind": "cpu"}


@pytest.mark.parametrize("platform, kind, count, memory, profile", [
    ("tpu", "TPU v5 lite", 4, 16 * 2**30, "tpu-v5e"),
    ("tpu", "TPU v5", 4, 95 * 2**30, "tpu-v5p"),
    ("tpu", "TPU v6 lite", 8, 32 * 2**30, "tpu-v6e"),
    ("gpu", "NVIDIA H100 80GB HBM3", 8, 80 * 2**30, "h100"),
    ("gpu", "NVIDIA H200", 8, 141 * 2**30, "h200"),
    ("cpu", "cpu", 1, None, "local-cpu"),
])
def test_jax_names_map_to_the_catalog(platform, kind, count, memory, profile):
    found = {"platform": platform, "device_kind": kind, "count": count, "memory_bytes": memory}
    hardware = host_hardware(None, None, probe=lambda env: found)
    assert hardware == HostHardware(profile, count, memory, kind)
    assert hardware.info() == {"jax_device_kind": kind}
    # --devices still sets the count (simulated CPU hosts own several devices).
    assert host_hardware(None, 2, probe=lambda env: found).device_count == 2


def test_devices_outside_the_catalog_and_bad_flags_are_clear_errors():
    unknown = {"platform": "tpu", "device_kind": "TPU v4", "count": 4, "memory_bytes": None}
    with pytest.raises(HardwareError, match="'TPU v4'.*pass --device-kind"):
        host_hardware(None, None, probe=lambda env: unknown)
    with pytest.raises(HardwareError, match="--device-kind: 'tpu-v4' is not a hardware profile; known: .*tpu-v5e"):
        host_hardware("tpu-v4", None, probe=lambda env: pytest.fail("the flag skips the probe"))
    assert host_hardware("tpu-v5e", 4, probe=lambda env: pytest.fail("no probe")) == \
        HostHardware("tpu-v5e", 4, None, None)


def test_a_probe_that_fails_says_what_to_pass():
    from worker.hardware import probe_devices

    with pytest.raises(HardwareError, match="failed .*pass --device-kind"):
        probe_devices(env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "no-such-platform"})
