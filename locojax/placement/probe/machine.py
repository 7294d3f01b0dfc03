"""The machine's basic rates: float32 matmul FLOP/s, memory bandwidth, the latency of one jitted
dispatch + sync, the host cost of a GSM8K reward, and a cross-process all-reduce (two subprocesses
joined by `jax.distributed` over loopback, the way local "hosts" talk)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from typing import Any, Callable

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
    try:
        from locojax.tasks import Example

        example = Example(uid="probe", prompt="", reference=GSM8K_COMPLETION, answer="72",
                          meta={"answer_format": "gsm8k"})
        if reward(GSM8K_COMPLETION, example) <= 0:
            return None
    except Exception:  # noqa: BLE001 - a changed reward API is skipped, not fatal
        return None
    return _best_time(lambda: [reward(GSM8K_COMPLETION, example) for _ in range(samples)], 3) / samples


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
