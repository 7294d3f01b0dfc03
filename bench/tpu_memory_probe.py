"""Where a TPU runtime counts a program's temporaries (issue 37's `peak_device_vs_plan`).

    python3 bench/tpu_memory_probe.py OUT.json      (on the chip; seconds)

One program with ~3 GiB of float32 temporaries (two [4096, 65536] intermediates feeding a matmul and a
sort) and a scalar out, then a 1 GiB array kept alive; the device's `memory_stats()` before, after
compiling, after running and after the live array, beside XLA's memory analysis of the program.
Measured on a v5e (bench/results/tpu_memory_probe_tpu.json): the temporaries leave `peak_bytes_in_use`
as it was and appear in `bytes_reserved` / `peak_bytes_reserved` instead, while the live array counts in
`bytes_in_use`. So a device's peak is the sum of the two (`locojax.metrics.device_peak_bytes`).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp


@jax.jit
def temporaries_only(x):
    big = jnp.sin(x[:, None] * jnp.arange(65536, dtype=jnp.float32)[None, :])  # [4096, 65536] f32: 1 GiB
    big2 = jnp.cos(big) * 2.0  # another GiB
    return (big @ big2.T).sum() + jnp.sort(big2.ravel())[0]


def main(out_path: str) -> None:
    device = jax.devices()[0]
    record = {"platform": device.platform, "device_kind": device.device_kind, "before": device.memory_stats()}
    x = jnp.arange(4096, dtype=jnp.float32)
    analysis = temporaries_only.lower(x).compile().memory_analysis()
    record["analysis"] = {key: getattr(analysis, key) for key in (
        "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
        "generated_code_size_in_bytes")}
    record["after_compile"] = device.memory_stats()
    float(temporaries_only(x))
    record["after_run"] = device.memory_stats()
    live = jnp.ones((1024, 1024, 256), jnp.float32)  # 1 GiB kept alive
    live.block_until_ready()
    record["after_live_1gib"] = device.memory_stats()
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=1, default=str)
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
