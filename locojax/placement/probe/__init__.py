"""`locojax probe`: measure this machine and write the `local-cpu` hardware profile.

Measures what the cost model needs from the local CPU: float32 matmul FLOP/s (a large matmul), the
engine's own kernels (train step and rollout of the `tiny` and `small` presets, timed in the process
layouts the modes use and fitted to the cost model's CPU terms per model width: that is what the
profile's rates come from), memory bandwidth, the latency of one jitted dispatch + sync, a
cross-process all-reduce (two subprocesses joined by `jax.distributed` over loopback, the way local
"hosts" talk), and the host cost of a GSM8K reward.
The result is a JSON file with a `profile` mapping (fields of `HardwareProfile`, read back by
`hardware.load_local_cpu_profile`) and the raw `measurements`.

Split by responsibility: `machine` (basic rates, reward cost, all-reduce), `contention` (the
contention meter), `kernels` (engine kernel timing in worker processes), `fit` (rates and profile).
`python -m locojax.placement.probe kernel-worker|all-reduce-worker` runs one of the worker processes.
"""

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from locojax.placement.probe.contention import (  # noqa: F401  (the probe's public names)
    ContentionMeter,
    contention,
    span_contention,
    work_totals,
)
from locojax.placement.probe.fit import fit_kernel_rates, profile_from_measurements  # noqa: F401
from locojax.placement.probe.kernels import (  # noqa: F401
    KERNEL_REPEATS,
    PROBE_PRESETS,
    QUICK_SHAPES_PER_KIND,
    KernelProbe,
    kernel_list,
    kernel_uncontended_s,
)
from locojax.placement.probe.machine import (  # noqa: F401
    measure_all_reduce,
    measure_dispatch_latency,
    measure_matmul_flops,
    measure_memory_bandwidth,
    measure_reward_cost,
)


def run_probe(quick: bool = False, all_reduce: bool = True, presets: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Measure this machine; returns {"profile": {...}, "measurements": {...}, "machine": {...}}.

    `presets`: the engine models whose kernels are timed (default tiny and small; tiny with `quick`).
    """
    presets = presets or (("tiny",) if quick else PROBE_PRESETS)
    repeats = 1 if quick else KERNEL_REPEATS
    measurements: dict[str, Any] = {
        "matmul_flops": measure_matmul_flops(512 if quick else 1024, 3 if quick else 5),
        "memory_bandwidth": measure_memory_bandwidth(16 if quick else 64, 3 if quick else 5),
        "dispatch_s": measure_dispatch_latency(50 if quick else 200),
        **measure_reward_cost(500 if quick else 2000),
    }
    cores = len(os.sched_getaffinity(0))
    cache = tempfile.TemporaryDirectory(prefix="locojax-probe-")  # the layouts share compiled programs
    try:
        with KernelProbe(presets, cache_dir=cache.name,
                         shapes_per_kind=QUICK_SHAPES_PER_KIND if quick else None) as probe:
            measurements["kernels_pinned"] = probe.measure_all(repeats)
    finally:
        cache.cleanup()
    if all_reduce:
        timings = measure_all_reduce(iterations=5 if quick else 20)
        measurements["all_reduce_small_s"] = timings["small_s"]
        measurements["all_reduce_large_s"] = timings["large_s"]
    profile = profile_from_measurements(measurements, cores)
    return {
        "profile": profile,
        "measurements": measurements,
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    }


def write_probe(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path
