"""`locojax probe`: measure this machine and write the `local-cpu` hardware profile.

Measures what the cost model needs from the local CPU: float32 matmul FLOP/s (a large matmul, and the
effective rate and fixed per-step time of the engine's own `tiny` and `small` models, which is what the
profile uses), memory bandwidth, the latency of one jitted dispatch + sync, a cross-process all-reduce (two subprocesses joined by
`jax.distributed` over loopback, the way local "hosts" talk), and the host cost of a GSM8K reward.
The result is a JSON file with a `profile` mapping (fields of `HardwareProfile`, read back by
`hardware.load_local_cpu_profile`) and the raw `measurements`.

Run as a module with `all-reduce-worker` to be one of the two all-reduce processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from locojax.placement.workloads import REFERENCE_REGEX_PARSE_S

# Payloads of the all-reduce: a small one for latency, a large one for bandwidth.
SMALL_ALL_REDUCE_BYTES = 1024
LARGE_ALL_REDUCE_BYTES = 16 * 2**20
ALL_REDUCE_TIMEOUT_S = 120

# A GSM8K reference solution, the text a reward parses.
GSM8K_COMPLETION = ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n"
                    "#### 72")
GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def _best_time(run: Callable[[], Any], repeats: int) -> float:
    """Fastest of `repeats` timed calls: the machine is shared, the minimum is the least disturbed."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(size: int = 1024, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.float32)
    b = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    return 2 * size**3 / _best_time(lambda: matmul(a, b).block_until_ready(), repeats)


def measure_memory_bandwidth(megabytes: int = 64, repeats: int = 5) -> float:
    """Bytes/s of a streaming read + write (x * 2 over a buffer larger than the caches)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    scale = jax.jit(lambda v: v * 2.0)
    scale(x).block_until_ready()
    return 2 * x.nbytes / _best_time(lambda: scale(x).block_until_ready(), repeats)


def measure_dispatch_latency(calls: int = 200) -> float:
    """Seconds per call of a trivial jitted function, dispatched and waited on."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((8,), jnp.float32)
    step = jax.jit(lambda v: v + 1.0)
    step(x).block_until_ready()

    def run() -> None:
        for _ in range(calls):
            step(x).block_until_ready()

    return _best_time(run, 3) / calls


def measure_engine_rates(quick: bool = False) -> dict[str, float]:
    """Effective FLOP/s and fixed per-step time of the engine's own model on this CPU.

    Times a decode loop and a forward + backward pass of the `tiny` and `small` presets and fits
    time = FLOPs / rate + fixed through the two: small models are dominated by the fixed part, which
    a large-matmul peak does not show. FLOPs are counted the way the cost model counts them.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from locojax.model import PRESETS, create_model, forward, init_cache, param_count

    batch, prompt_len, new_tokens = (8, 8, 4) if quick else (32, 32, 16)
    slots = prompt_len + new_tokens
    decode_points, train_points = [], []
    for preset in ("tiny", "small"):
        config = PRESETS[preset]
        graphdef, params = nnx.split(create_model(config))
        kv_mask = jnp.ones((batch, slots), bool)

        def decode(params, cache):
            def one_step(i, carry):
                cache, token = carry
                logits, cache = forward(graphdef, params, token, jnp.full((batch, 1), i), kv_mask, cache, i)
                return cache, jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)

            return jax.lax.fori_loop(0, new_tokens, one_step, (cache, jnp.zeros((batch, 1), jnp.int32)))

        decode_jit = jax.jit(decode)
        cache = init_cache(config, batch, slots)
        jax.block_until_ready(decode_jit(params, cache))
        decode_s = _best_time(lambda: jax.block_until_ready(decode_jit(params, cache)), 3) / new_tokens

        tokens = jnp.zeros((batch, slots), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(slots), (batch, slots))

        def loss(params):
            logits, _ = forward(graphdef, params, tokens, positions, kv_mask)
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

        grad = jax.jit(jax.value_and_grad(loss))
        jax.block_until_ready(grad(params))
        train_s = _best_time(lambda: jax.block_until_ready(grad(params)), 3)

        n, width = param_count(config), config.n_heads * config.head_dim
        decode_flops = 2 * n * batch + 4 * config.n_layers * width * batch * slots
        train_flops = batch * slots * (6 * n + 3 * 4 * config.n_layers * width * slots / 2)
        decode_points.append((decode_flops, decode_s))
        train_points.append((train_flops, train_s))

    def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
        (f1, t1), (f2, t2) = points
        if t2 <= t1:  # noise swamped the difference: all of it is rate
            return f2 / t2, 0.0
        rate = (f2 - f1) / (t2 - t1)
        return rate, max(t1 - f1 / rate, 0.0)

    decode_rate, decode_fixed = fit(decode_points)
    train_rate, train_fixed = fit(train_points)
    return {"decode_flops_per_s": decode_rate, "decode_step_fixed_s": decode_fixed,
            "train_flops_per_s": train_rate, "train_step_fixed_s": train_fixed}


def measure_reward_cost(samples: int = 2000) -> dict[str, float | None]:
    """Host seconds per sample: the `#### N` regex parse, and the registered gsm8k reward if there is one."""

    def parse() -> None:
        for _ in range(samples):
            match = GSM8K_ANSWER.search(GSM8K_COMPLETION)
            assert match is not None and float(match.group(1).replace(",", "")) == 72.0

    regex_s = _best_time(parse, 3) / samples
    return {"regex_parse_s": regex_s, "gsm8k_reward_s": _registered_gsm8k_reward_cost(samples // 10)}


def _registered_gsm8k_reward_cost(samples: int) -> float | None:
    """Time `locojax.rewards`' gsm8k reward if that registry exists; its call signature is tried, not assumed."""
    try:
        import locojax.rewards as rewards
    except ImportError:
        return None
    registry = getattr(rewards, "REWARDS", None)
    if registry is None or "gsm8k" not in registry:
        return None
    reward = registry.get("gsm8k")
    for call in (lambda: reward([GSM8K_COMPLETION], ["72"]), lambda: reward(GSM8K_COMPLETION, "72"),
                 lambda: reward(completions=[GSM8K_COMPLETION], answers=["72"])):
        try:
            call()
        except Exception:  # noqa: BLE001 - an unknown signature is skipped, not fatal
            continue
        return _best_time(lambda: [call() for _ in range(samples)], 3) / samples
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_all_reduce(timeout_s: float = ALL_REDUCE_TIMEOUT_S, iterations: int = 20) -> dict[str, float]:
    """A 2-process all-reduce over loopback: seconds for a small and a large payload."""
    port = free_port()
    command = [sys.executable, "-m", "locojax.placement.probe", "all-reduce-worker", "--port", str(port),
               "--iterations", str(iterations)]
    workers = [subprocess.Popen([*command, "--process-id", str(process_id)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for process_id in range(2)]
    outputs = []
    try:
        for worker in workers:
            stdout, stderr = worker.communicate(timeout=timeout_s)
            if worker.returncode != 0:
                raise RuntimeError(f"all-reduce worker failed ({worker.returncode}): {stderr.strip()[-2000:]}")
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    # The slower process sees the whole collective; the other may have waited at its start.
    return {key: max(output[key] for output in outputs) for key in ("small_s", "large_s")}


def all_reduce_worker(process_id: int, port: int, iterations: int) -> dict[str, float]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    try:
        mesh = Mesh(np.array(jax.devices()), ("hosts",))
        rows = NamedSharding(mesh, PartitionSpec("hosts"))
        replicated = NamedSharding(mesh, PartitionSpec())
        reduce = jax.jit(lambda x: x.sum(axis=0), out_shardings=replicated)
        timings = {}
        for key, size in (("small_s", SMALL_ALL_REDUCE_BYTES), ("large_s", LARGE_ALL_REDUCE_BYTES)):
            values = size // 4
            local = np.ones((1, values), np.float32)  # [1, values] on each of the 2 processes
            global_array = jax.make_array_from_process_local_data(rows, local, (2, values))
            reduce(global_array).block_until_ready()
            timings[key] = _best_time(lambda: reduce(global_array).block_until_ready(), iterations)
        return timings
    finally:
        jax.distributed.shutdown()


def run_probe(quick: bool = False, all_reduce: bool = True) -> dict[str, Any]:
    """Measure this machine; returns {"profile": {...}, "measurements": {...}, "machine": {...}}."""
    measurements: dict[str, Any] = {
        "matmul_flops": measure_matmul_flops(512 if quick else 1024, 3 if quick else 5),
        "memory_bandwidth": measure_memory_bandwidth(16 if quick else 64, 3 if quick else 5),
        "dispatch_s": measure_dispatch_latency(50 if quick else 200),
        **measure_reward_cost(500 if quick else 2000),
        **measure_engine_rates(quick),
    }
    profile: dict[str, Any] = {
        # The rates the engine's own small matmuls reach, not the large-matmul peak.
        "peak_flops": measurements["decode_flops_per_s"],
        "train_mfu": min(1.0, measurements["train_flops_per_s"] / measurements["decode_flops_per_s"]),
        "decode_step_overhead_s": measurements["decode_step_fixed_s"],
        "train_step_overhead_s": measurements["train_step_fixed_s"],
        "hbm_bandwidth": measurements["memory_bandwidth"],
        "ici_bandwidth": measurements["memory_bandwidth"],  # devices of one process share memory
        "pcie_bandwidth": measurements["memory_bandwidth"],
        "dispatch_s": measurements["dispatch_s"],
        "reward_cpu_scale": measurements["regex_parse_s"] / REFERENCE_REGEX_PARSE_S,
    }
    if all_reduce:
        timings = measure_all_reduce(iterations=5 if quick else 20)
        measurements["all_reduce_small_s"] = timings["small_s"]
        measurements["all_reduce_large_s"] = timings["large_s"]
        # The cost model charges a 2-process ring all-reduce 2 latencies plus S bytes through a NIC.
        profile["dcn_latency_s"] = timings["small_s"] / 2
        extra = max(timings["large_s"] - timings["small_s"], 1e-9)
        profile["dcn_bandwidth_per_chip"] = (LARGE_ALL_REDUCE_BYTES - SMALL_ALL_REDUCE_BYTES) / extra
    sources = {field: "locojax probe" for field in profile}
    return {
        "profile": {**profile, "sources": sources},
        "measurements": measurements,
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    }


def write_probe(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m locojax.placement.probe")
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("all-reduce-worker", help="one of the two processes of the all-reduce measurement")
    worker.add_argument("--port", type=int, required=True)
    worker.add_argument("--process-id", type=int, required=True)
    worker.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args(argv)
    print(json.dumps(all_reduce_worker(args.process_id, args.port, args.iterations)), flush=True)


if __name__ == "__main__":
    _main()
