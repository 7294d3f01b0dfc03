"""Kernel timing: the engine's own jitted train step and rollout, held compiled in worker processes
laid out as the modes use the machine and timed on request, net of contention."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from locojax.placement.probe.contention import span_contention, thread_schedstats, work_totals

# The engine's own kernels, timed where the modes run them
#
# A CPU runs the small models of this engine far below its large-matmul peak, and not at one rate:
# attention (masked softmax over the cache at head_dim 16-64) is elementwise, memory-bound work, and
# decode adds per-sequence work that is no matmul at all (sampling over the vocabulary). So the probe
# times the real jitted train step and rollout (`locojax.train`, `locojax.rollout`) of the engine's
# presets at a few shapes and fits, per model width, the cost model's CPU terms against the FLOP
# counts the cost model itself uses (`cost_model.train_flops`, `prefill_flops`, `decode_step_flops`):
#     train    = train_step_overhead + param_flops * a + attention_flops * b
#                + scored slots * train_scored_token_overhead     (vocabulary work on completion slots)
#     generate = prefill (param * p + attention * p * b / a) + (n - 1) decode steps (param * a + attention * d)
#                + n * (batch * decode_row_overhead + decode_step_overhead)
# (decode's matmuls at training's rate a: what decode does besides is its per-row and per-step work;
# prefill, a forward pass, at its own rate p, attention relative to it as in training). The fit is a
# bounded, robust least squares, each kernel weighted by 1/sqrt(its time) (`fit_kernel_rates`).
# The layout is the one every mode uses the machine in: one process per core, each pinned to its core,
# all running at once (CO hosts, SC's workers, DA's actors); a kernel's time is the slowest process's,
# as a lockstep step sees it. Shapes are per device: (sequences, prompt tokens, new tokens).

PROBE_PRESETS = ("tiny", "small")
# (sequences, prompt length, new tokens) per device. They span the steps of GRPO runs on a CPU: short
# and long completions, and from one to eight of the engine's 8,192-slot CPU micro-batches. The step
# time is not linear in the cost model's terms here (whether a step's attention scores stay in cache
# changes with its size), so a fit from small kernels alone over-predicted 50k-slot steps by 20-30%.
KERNEL_SHAPES: dict[str, dict[str, list[tuple[int, int, int]]]] = {
    "tiny": {"train": [(32, 32, 32), (8, 96, 160), (64, 48, 16), (16, 64, 64), (128, 96, 8),
                       (384, 64, 16), (24, 64, 224), (48, 128, 128), (640, 80, 16)],
             "generate": [(16, 32, 32), (4, 96, 160), (64, 32, 8), (32, 64, 64), (128, 96, 2),
                          (384, 64, 16), (24, 64, 224), (48, 128, 128)]},
    "small": {"train": [(8, 32, 32), (2, 96, 160), (16, 48, 16), (4, 64, 64), (16, 96, 8),
                        (96, 64, 16), (6, 64, 224), (12, 128, 128)],
              "generate": [(4, 32, 32), (2, 96, 160), (16, 32, 8), (8, 64, 64), (16, 96, 2),
                           (96, 64, 16), (6, 64, 224), (12, 128, 128)]},
}
KERNEL_REPEATS = 3
# `locojax probe --quick`: the first shapes of each kind only. Compiling is most of a probe's time on
# a CPU (about 13 s a kernel on 2 cores), and five shapes a kind still determine the four terms a kind
# fits, if less firmly than all of them.
QUICK_SHAPES_PER_KIND = 5
WORKER_START_TIMEOUT_S = 600


def kernel_list(presets: tuple[str, ...] = PROBE_PRESETS, shapes_per_kind: int | None = None) -> list[dict[str, Any]]:
    return [{"preset": preset, "kind": kind, "shape": list(shape)}
            for preset in presets for kind in ("train", "generate")
            for shape in KERNEL_SHAPES[preset][kind][:shapes_per_kind]]


def _build_kernels(kernels: list[dict[str, Any]], devices: int, first: int = 0) -> list[Callable[[], Any]]:
    """One zero-argument callable per kernel that runs it once and blocks until it is done, in the order
    of `kernels`; built (and compiled) starting at kernel `first`, wrapping around."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from locojax.model.sharding import batch_sharding, make_mesh, shard_state
    from locojax.policy import load_policy, sampling_config
    from locojax.rollout import make_generate_fn
    from locojax.spec import parse_spec
    from locojax.train import init_train_state, make_optimizer, make_train_step

    local = jax.local_devices()[:devices]
    runs: list[Callable[[], Any] | None] = [None] * len(kernels)
    for index in [*range(first, len(kernels)), *range(first)]:
        kernel = kernels[index]
        batch, prompt_len, new_tokens = kernel["shape"]
        spec = parse_spec({"name": "probe", "model": {"preset": kernel["preset"]}, "task": {"name": "arith"},
                           "rollout": {"prompts_per_step": 1, "group_size": 2, "max_prompt_tokens": prompt_len,
                                       "max_new_tokens": new_tokens, "temperature": 1.0},
                           "steps": 2})
        policy = load_policy(spec)
        if kernel["kind"] == "generate":
            sampling = sampling_config(spec, policy.tokenizer)
            prompt = np.full((batch, prompt_len), 65, np.int32)  # never EOS: decode runs to the cap
            mask = np.ones((batch, prompt_len), bool)
            key = jax.random.PRNGKey(0)
            calls = []
            for offset, device in enumerate(local):
                generate = make_generate_fn(policy.config, policy.graphdef, sampling, prompt_len, batch, (device,))
                params = jax.device_put(policy.params, device)
                calls.append((generate, params, offset * batch))

            def run(calls=calls, prompt=prompt, mask=mask, key=key):
                jax.block_until_ready([g(p, prompt, mask, key, o) for g, p, o in calls])
        else:
            mesh = make_mesh(local)
            optimizer = make_optimizer(spec.optim, spec.steps)
            step = make_train_step(policy.graphdef, optimizer, spec.algo)
            state = init_train_state(shard_state(policy.params, mesh), optimizer)
            rows = batch * len(local)
            host = {"tokens": np.full((rows, prompt_len + new_tokens), 65, np.int32),
                    "prompt_mask": np.ones((rows, prompt_len), bool),
                    "completion_mask": np.ones((rows, new_tokens), bool),
                    "old_logprobs": np.zeros((rows, new_tokens), np.float32),
                    "advantages": np.ones((rows,), np.float32)}
            data = {k: jax.device_put(v, batch_sharding(mesh, v.ndim)) for k, v in host.items()}
            holder = {"state": jax.device_put(state, NamedSharding(mesh, PartitionSpec()))}

            def run(step=step, data=data, holder=holder):
                holder["state"], _ = step(holder["state"], data)
                jax.block_until_ready(holder["state"])
        run()  # compile
        runs[index] = run
    return runs


def kernel_worker(devices: int, kernels: list[dict[str, Any]], cache_dir: str | None = None, first: int = 0) -> None:
    """Serve kernel timings on stdin/stdout: `{"run": i}` -> `{"t": seconds, "contention": x}`; EOF ends.
    `first`: the kernel this worker compiles first (see KernelProbe)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    if cache_dir:  # workers of one probe compile the same programs: the first fills the cache
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    runs = _build_kernels(kernels, devices, first)
    print(json.dumps({"ready": len(runs)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "run" not in command:
            break
        before = thread_schedstats([os.getpid()])
        start = time.perf_counter()
        runs[command["run"]]()
        elapsed = time.perf_counter() - start
        totals = work_totals(before, thread_schedstats([os.getpid()]), elapsed)
        print(json.dumps({"t": elapsed, "contention": span_contention(totals)}), flush=True)


def kernel_uncontended_s(replies: list[tuple[float, float]]) -> float:
    """One repeat of a kernel on cores free of other work, from each worker's (seconds, contention):
    the workers run independently, so it is done when the slowest is."""
    return max(t / c for t, c in replies)


class KernelProbe:
    """Worker processes holding the compiled kernels, timed on request (see the section comment).

    One single-device worker per core, pinned to it: the layout of every mode's processes, SC's included
    (its workers own the devices). Close it (or use it as a context manager) to stop the workers.
    """

    def __init__(self, presets: tuple[str, ...] = PROBE_PRESETS, cores: list[int] | None = None,
                 cache_dir: str | None = None, shapes_per_kind: int | None = None):
        self.kernels = kernel_list(presets, shapes_per_kind)
        self.cores = cores or sorted(os.sched_getaffinity(0))
        # A compilation cache shared by the workers (and by probes given the same `cache_dir`).
        self._cache = None if cache_dir else tempfile.TemporaryDirectory(prefix="locojax-probe-")
        command = [sys.executable, "-m", "locojax.placement.probe", "kernel-worker", "--kernels",
                   json.dumps(self.kernels), "--cache-dir", cache_dir or self._cache.name]
        self.workers: list[subprocess.Popen] = []
        try:
            # All at once, each compiling from its own point of the list onwards: a kernel that another
            # worker has compiled by the time this one gets to it comes from the shared cache, so the
            # cores compile different kernels side by side (compiling is most of a probe's time).
            for position, core in enumerate(self.cores):
                first = position * len(self.kernels) // len(self.cores)
                self.workers.append(subprocess.Popen(
                    [*command, "--devices", "1", "--core", str(core), "--first", str(first)], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
            for worker in self.workers:
                self._read(worker)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _read(worker: subprocess.Popen) -> dict[str, Any]:
        while True:
            line = worker.stdout.readline()
            if not line:
                raise RuntimeError(f"probe kernel worker exited ({worker.poll()})")
            if line.startswith("{"):
                return json.loads(line)

    def index(self, preset: str, kind: str, shape: tuple[int, int, int]) -> int:
        return self.kernels.index({"preset": preset, "kind": kind, "shape": list(shape)})

    def run_once(self, index: int) -> list[tuple[float, float]]:
        """Kernel `index` run once by every worker at once: each worker's (seconds, contention)."""
        for worker in self.workers:
            worker.stdin.write(json.dumps({"run": index}) + "\n")
            worker.stdin.flush()
        return [(r["t"], r["contention"]) for r in (self._read(worker) for worker in self.workers)]

    @staticmethod
    def summary(reps: list[list[tuple[float, float]]]) -> dict[str, Any]:
        """The medians over repeats of a kernel's time on cores free of other work (`s`: the slowest
        worker's wall time over its own contention) and of its wall time (`wall_s`), and the repeats."""
        return {"s": statistics.median(kernel_uncontended_s(rep) for rep in reps),
                "wall_s": statistics.median(max(t for t, _ in rep) for rep in reps), "reps": reps}

    def measure_all(self, repeats: int = KERNEL_REPEATS) -> list[dict[str, Any]]:
        """Every kernel `repeats` times, in `repeats` passes over all of them rather than each kernel's
        repeats in a row: this VM has slow spells of several seconds that the scheduler's accounting
        does not show (one probe timed every rollout kernel 25-55% slow), and a spell that falls in
        one pass then spoils one repeat of a few kernels, which their medians drop."""
        reps: list[list[list[tuple[float, float]]]] = [[] for _ in self.kernels]
        for _ in range(repeats):
            for index in range(len(self.kernels)):
                reps[index].append(self.run_once(index))
        return [{**kernel, **self.summary(mine)} for kernel, mine in zip(self.kernels, reps)]

    def close(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                try:
                    worker.stdin.close()
                    worker.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    worker.kill()
                    worker.wait()
        self.workers = []
        if self._cache is not None:
            self._cache.cleanup()
            self._cache = None

    def __enter__(self) -> "KernelProbe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
