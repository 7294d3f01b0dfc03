"""`locojax probe`: measure this machine and write the `local-cpu` hardware profile.

Measures what the cost model needs from the local CPU: float32 matmul FLOP/s (a large matmul), the
engine's own kernels (train step and rollout of the `tiny` and `small` presets, timed in the process
layouts the modes use and fitted to the cost model's CPU terms per model width: that is what the
profile's rates come from), memory bandwidth, the latency of one jitted dispatch + sync, a
cross-process all-reduce (two subprocesses joined by `jax.distributed` over loopback, the way local
"hosts" talk), and the host cost of a GSM8K reward.
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
import statistics
import subprocess
import sys
import tempfile
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


# ---------------------------------------------------------------------------------------------------
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
# Two layouts, as the modes use the machine:
#   pinned      one process per core, each pinned to its core, all running at once (CO hosts, DA
#               actors); a kernel's time is the slowest process's, as a lockstep step sees it;
#   controller  one process driving one device per core (SC's controller): rollouts dispatched to
#               every device at once, training on a mesh of all of them.
# Shapes are per device: (sequences, prompt tokens, new tokens).

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
WORKER_START_TIMEOUT_S = 600


def kernel_list(presets: tuple[str, ...] = PROBE_PRESETS) -> list[dict[str, Any]]:
    return [{"preset": preset, "kind": kind, "shape": list(shape)}
            for preset in presets for kind in ("train", "generate") for shape in KERNEL_SHAPES[preset][kind]]


def _build_kernels(kernels: list[dict[str, Any]], devices: int) -> list[Callable[[], Any]]:
    """One zero-argument callable per kernel that runs it once and blocks until it is done."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from locojax.model.sharding import batch_sharding, make_mesh, shard_state
    from locojax.modes.common import load_policy, sampling_config
    from locojax.rollout import make_generate_fn
    from locojax.spec import parse_spec
    from locojax.train import init_train_state, make_optimizer, make_train_step

    local = jax.local_devices()[:devices]
    runs = []
    for kernel in kernels:
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
        runs.append(run)
    return runs


def kernel_worker(devices: int, kernels: list[dict[str, Any]], cache_dir: str | None = None) -> None:
    """Serve kernel timings on stdin/stdout: `{"run": i}` -> `{"t": seconds, "contention": x}`; EOF ends."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    if cache_dir:  # workers of one probe compile the same programs: the first fills the cache
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    runs = _build_kernels(kernels, devices)
    print(json.dumps({"ready": len(runs)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "run" not in command:
            break
        before = _thread_schedstats([os.getpid()])
        start = time.perf_counter()
        runs[command["run"]]()
        elapsed = time.perf_counter() - start
        totals = work_totals(before, _thread_schedstats([os.getpid()]), elapsed)
        print(json.dumps({"t": elapsed, "contention": span_contention(totals)}), flush=True)


# ---------------------------------------------------------------------------------------------------
# CPU contention, from the scheduler's own accounting
#
# This machine may be shared with other work. Linux records, per thread, the time it ran and the time
# it sat runnable on a run queue waiting for a core (/proc/<pid>/task/<tid>/schedstat). Over a span of
# `elapsed` seconds, the threads of our processes (on `cores` cores) wanted (run + wait) / elapsed
# cores on average and got run / elapsed. Without other work they would have got all they wanted, up
# to the cores there are, so other work slowed them by
#     contention = min(run + wait, cores * elapsed) / run        (at least 1).
# Waiting for our own threads beyond the cores (one process running more threads than cores, as SC's
# controller does) is not other work's doing: the cap keeps it in the measured times, where the cost
# model's layouts account for it. The probe states its rates for cores free of other work by dividing
# each kernel's time by its contention; a measured run's contention says how much slower than that
# the cores were for it (HardwareProfile.device_time_scale).


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - a process that ended mid-walk
        return [pid]


def _thread_schedstats(pids: list[int]) -> dict[tuple[int, int], tuple[int, int]]:
    """{(pid, tid): (ns on CPU, ns waiting runnable)} for every thread of `pids`."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run_ns, wait_ns, _ = f.read().split()
            except (OSError, ValueError):
                continue
            out[(pid, int(tid))] = (int(run_ns), int(wait_ns))
    return out


def contention(elapsed_s: float, cpu_s: float, wait_s: float, cores: int) -> float:
    """How much other work slowed a span's threads (see the section comment); 1 without any."""
    if cpu_s <= 0 or elapsed_s <= 0:
        return 1.0
    return max(1.0, min(cpu_s + wait_s, cores * elapsed_s) / cpu_s)


# Whose contention counts. Threads that ran less than WORK_THREAD_MIN_SHARE of a span are helpers
# (pollers, loggers, idle pools): their short wake-ups wait disproportionately long on a busy machine.
# The processes whose other threads were runnable (running or waiting) for at least
# STEP_PROCESS_MIN_RUNNABLE of the span are the ones the step waited on: both CO hosts (a lockstep
# step), SC's controller, DA's longer branch (not the rollout actor idling between batches while
# training runs). A step waits for the slowest of them, and other work need not load every core
# alike, so a span's contention is the largest of theirs. Without such processes, all work threads count.
WORK_THREAD_MIN_SHARE = 0.05
STEP_PROCESS_MIN_RUNNABLE = 0.75


def work_totals(before: dict[tuple[int, int], tuple[int, int]], after: dict[tuple[int, int], tuple[int, int]],
                elapsed_s: float, cores: dict[int, int] | None = None) -> dict[str, Any]:
    """Run and wait seconds between two `_thread_schedstats` snapshots of the threads that carried the
    span (see above; a thread missing from `before` started in it), per process:
    {"elapsed_s", "processes": [{"pid", "cpu_s", "wait_s", "cores"}], "work_processes"}; `cores`: the
    cores each process may run on, where known (else read now)."""
    per_process: dict[int, list[float]] = {}
    for (pid, tid), (run_ns, wait_ns) in after.items():
        run0, wait0 = before.get((pid, tid), (0, 0))
        d_run, d_wait = max(0, run_ns - run0) / 1e9, max(0, wait_ns - wait0) / 1e9
        if d_run >= WORK_THREAD_MIN_SHARE * elapsed_s:
            totals = per_process.setdefault(pid, [0.0, 0.0])
            totals[0] += d_run
            totals[1] += d_wait
    step = {pid: t for pid, t in per_process.items() if t[0] + t[1] >= STEP_PROCESS_MIN_RUNNABLE * elapsed_s}
    if step:
        processes = [{"pid": pid, "cpu_s": t[0], "wait_s": t[1], "cores": (cores or {}).get(pid) or _cores_of(pid)}
                     for pid, t in step.items()]
    else:  # no process carried the span: all work threads together
        processes = [{"pid": None, "cpu_s": sum(t[0] for t in per_process.values()),
                      "wait_s": sum(t[1] for t in per_process.values()), "cores": len(os.sched_getaffinity(0))}]
    return {"elapsed_s": elapsed_s, "processes": processes, "work_processes": len(per_process)}


def _cores_of(pid: int) -> int:
    try:
        return len(os.sched_getaffinity(pid))
    except OSError:  # it ended: assume the machine
        return len(os.sched_getaffinity(0))


def span_contention(totals: dict[str, Any]) -> float:
    """The contention of a `work_totals` span: the largest of its step processes' (see above)."""
    return max((contention(totals["elapsed_s"], p["cpu_s"], p["wait_s"], p["cores"]) for p in totals["processes"]),
               default=1.0)


class ContentionMeter:
    """Samples the run and wait time of every thread of a process tree (this process and its
    descendants) in a background thread; `window(t0, t1)` sums them over the span for the processes
    that carried it, and `contention(t0, t1)` says how much other work slowed them (1: not)."""

    def __init__(self, root: int | None = None, interval_s: float = 0.25):
        import threading

        self.root = root or os.getpid()
        self.interval_s = interval_s
        self.snapshots: list[tuple[float, dict[tuple[int, int], tuple[int, int]]]] = []
        self.cores: dict[int, int] = {}  # pid -> cores it may run on, as last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="contention-meter", daemon=True)

    def _sample(self) -> None:
        pids = _descendants(self.root)
        for pid in pids:  # processes may pin themselves after they start (DA's actors do)
            try:
                self.cores[pid] = len(os.sched_getaffinity(pid))
            except OSError:
                pass
        self.snapshots.append((time.monotonic(), _thread_schedstats(pids)))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> "ContentionMeter":
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def window(self, start: float, end: float) -> dict[str, Any]:
        """`work_totals` between the snapshots nearest at or before two `time.monotonic()` instants."""
        def at(t: float) -> tuple[float, dict]:
            before = [snapshot for snapshot in self.snapshots if snapshot[0] <= t]
            return before[-1] if before else self.snapshots[0]

        (t0, first), (t1, last) = at(start), at(end)
        return work_totals(first, last, t1 - t0, self.cores)

    def contention(self, start: float, end: float) -> float:
        """How much other work slowed the tree between two instants (see the section comment)."""
        return span_contention(self.window(start, end))


def kernel_uncontended_s(replies: list[tuple[float, float]]) -> float:
    """One repeat of a kernel on cores free of other work, from each worker's (seconds, contention):
    the workers run independently, so it is done when the slowest is."""
    return max(t / c for t, c in replies)


class KernelProbe:
    """Worker processes holding the compiled kernels, timed on request (see the section comment).

    layout "pinned": one single-device worker per core, pinned; "controller": one unpinned worker with
    one device per core. Close it (or use it as a context manager) to stop the workers.
    """

    def __init__(self, layout: str = "pinned", presets: tuple[str, ...] = PROBE_PRESETS,
                 cores: list[int] | None = None, cache_dir: str | None = None):
        if layout not in ("pinned", "controller"):
            raise ValueError(f"layout must be 'pinned' or 'controller', got {layout!r}")
        self.layout = layout
        self.kernels = kernel_list(presets)
        self.cores = cores or sorted(os.sched_getaffinity(0))
        # A compilation cache shared by the workers (and by probes given the same `cache_dir`).
        self._cache = None if cache_dir else tempfile.TemporaryDirectory(prefix="locojax-probe-")
        command = [sys.executable, "-m", "locojax.placement.probe", "kernel-worker", "--kernels",
                   json.dumps(self.kernels), "--cache-dir", cache_dir or self._cache.name]
        self.workers: list[subprocess.Popen] = []
        try:
            if layout == "pinned":
                # One after another: the first compiles, the others load its programs from the cache.
                for core in self.cores:
                    worker = subprocess.Popen([*command, "--devices", "1", "--core", str(core)], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                    self.workers.append(worker)
                    self._read(worker)
            else:
                worker = subprocess.Popen([*command, "--devices", str(len(self.cores))], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                self.workers.append(worker)
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


def fit_kernel_rates(timings: list[dict[str, Any]], matmul_flops: float, cores: int) -> dict[str, dict[str, float]]:
    """Per model width, the cost model's CPU rate fields from kernel timings (see the section comment).

    Rates are per device while every core is busy; the profile states them for the whole machine
    (`peak_flops` is shared by the busy chips), so per-device FLOP/s are multiplied by `cores`.
    Least squares on relative errors, within physical bounds: no kernel's matmuls run faster than the
    probe's large float32 matmul (`matmul_flops / cores` per device), and attention runs no faster
    than the matmuls (efficiency <= 1); overheads are >= 0. The kernels' shapes alone leave the
    matmul and attention terms nearly collinear, and without the bounds one probe of this machine
    fitted matmuls at 15x the measured peak with attention at 0.7% of it.
    """
    import numpy as np
    from scipy.optimize import least_squares, lsq_linear

    from locojax.model.config import PRESETS
    from locojax.placement.cost_model import ModelSize, decode_step_flops, prefill_flops, train_flops
    from locojax.placement.hardware import LOCAL_CPU

    def solve(rows: list[list[float]], targets: list[float], lower: list[float]) -> list[float]:
        a, y = np.asarray(rows, float), np.asarray(targets, float)
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        # Each kernel's error weighs 1/sqrt(its time): relative errors alone let the many short kernels
        # (where fixed costs rule) outvote the long ones that real steps are made of; absolute errors
        # alone would drop the short ones.
        weight = (y * np.median(y)) ** -0.5
        design, bounds = a / scale * weight[:, None], (np.asarray(lower) * scale, np.inf)
        start = np.clip(lsq_linear(design, y * weight, bounds=bounds).x, bounds[0], np.inf)
        # A robust loss: a kernel that ran through one of this VM's slow spells (which the scheduler's
        # accounting does not show: 0.47 s against 0.33 s in the other probes) counts linearly
        # beyond ~5% error instead of pulling the fit with its square.
        fit = least_squares(lambda x: design @ x - y * weight, start, bounds=bounds, loss="soft_l1", f_scale=0.05)
        return list(fit.x / scale)

    fastest = cores / matmul_flops  # seconds per FLOP of one device's share of the measured matmul peak

    out: dict[str, dict[str, float]] = {}
    for preset in dict.fromkeys(k["preset"] for k in timings):
        model = ModelSize.from_config(PRESETS[preset])
        mine = [k for k in timings if k["preset"] == preset]
        rows, targets = [], []
        for k in (k for k in mine if k["kind"] == "train"):
            batch, prompt_len, new_tokens = k["shape"]
            param, attention = train_flops(model, LOCAL_CPU, batch, prompt_len + new_tokens, new_tokens)
            # attention's seconds per FLOP b = a + extra, extra >= 0; then the per-scored-slot work
            # that is not a matmul (HardwareProfile.train_scored_token_overhead_s)
            rows.append([1.0, param + attention, attention, batch * new_tokens])
            targets.append(k["s"])
        train_fixed, a, extra, per_scored = solve(rows, targets, [0.0, fastest, 0.0, 0.0])
        b = a + extra
        rows, targets = [], []
        for k in (k for k in mine if k["kind"] == "generate"):
            batch, prompt_len, new_tokens = k["shape"]
            context = prompt_len + new_tokens  # dense attention over every cache slot (cost_model.decode_context)
            pf_param, pf_attention = prefill_flops(model, batch, prompt_len, context)
            dec_param, dec_attention = decode_step_flops(model, batch, context)
            # decode's matmuls and the floor of its attention at training's matmul rate a
            known = (new_tokens - 1) * a * (dec_param + dec_attention)
            prefill = pf_param + pf_attention * b / a
            rows.append([prefill, (new_tokens - 1) * dec_attention, new_tokens * batch, new_tokens])
            targets.append(max(k["s"] - known, 0.05 * k["s"]))
        p, d_extra, row_s, step_s = solve(rows, targets, [fastest, 0.0, 0.0, 0.0])
        d = a + d_extra
        rate = 1.0 / a if a > 0 else matmul_flops / cores  # per device, while all cores are busy
        peak = max(matmul_flops, rate * cores, cores / p if p > 0 else 0.0)

        def efficiency(seconds_per_flop: float) -> float:
            """Attention's rate relative to the matmul rate, in [1e-3, 1] (1 when the fit found no cost)."""
            return min(1.0, max(1e-3, 1.0 / seconds_per_flop / rate)) if seconds_per_flop > 0 else 1.0

        out[str(model.d_model)] = {
            "peak_flops": peak,
            "train_mfu": rate * cores / peak,
            "decode_mfu": rate * cores / peak,  # decode's matmuls at training's rate; the rest is row overhead
            "prefill_mfu": cores / p / peak if p > 0 else rate * cores / peak,
            "train_attention_efficiency": efficiency(b),
            "decode_attention_efficiency": efficiency(d),
            "decode_row_overhead_s": row_s,
            "decode_step_overhead_s": step_s,
            "train_step_overhead_s": train_fixed,
            "train_scored_token_overhead_s": per_scored,
        }
    return out


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


def run_probe(quick: bool = False, all_reduce: bool = True, presets: tuple[str, ...] | None = None,
              controller: bool = True) -> dict[str, Any]:
    """Measure this machine; returns {"profile": {...}, "measurements": {...}, "machine": {...}}.

    `presets`: the engine models whose kernels are timed (default tiny and small; tiny with `quick`).
    `controller`: also time the SC layout (one process driving every core's device).
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
        with KernelProbe("pinned", presets, cache_dir=cache.name) as probe:
            measurements["kernels_pinned"] = probe.measure_all(repeats)
        if controller and cores > 1:
            with KernelProbe("controller", presets, cache_dir=cache.name) as sc_probe:
                measurements["kernels_controller"] = sc_probe.measure_all(repeats)
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


def profile_from_measurements(measurements: dict[str, Any], cores: int) -> dict[str, Any]:
    """The `local-cpu` profile fields (with their sources) from `run_probe`'s measurements."""
    measured_rates = fit_kernel_rates(measurements["kernels_pinned"], measurements["matmul_flops"], cores)
    controller_rates: dict[str, dict[str, float]] = {}
    if "kernels_controller" in measurements:
        controller_rates = fit_kernel_rates(measurements["kernels_controller"], measurements["matmul_flops"], cores)
    first = next(iter(measured_rates.values()))
    profile: dict[str, Any] = {
        **first,  # models of another width take their nearest measured width (HardwareProfile.rates_for)
        "measured_rates": measured_rates,
        "controller_rates": controller_rates,
        "rates_include_memory": True,
        "hbm_bandwidth": measurements["memory_bandwidth"],
        "ici_bandwidth": measurements["memory_bandwidth"],  # devices of one process share memory
        "pcie_bandwidth": measurements["memory_bandwidth"],
        "dispatch_s": measurements["dispatch_s"],
        "reward_cpu_scale": measurements["regex_parse_s"] / REFERENCE_REGEX_PARSE_S,
    }
    if "all_reduce_small_s" in measurements:
        small, large = measurements["all_reduce_small_s"], measurements["all_reduce_large_s"]
        # The cost model charges a 2-process ring all-reduce 2 latencies plus S bytes through a NIC.
        profile["dcn_latency_s"] = small / 2
        profile["dcn_bandwidth_per_chip"] = (LARGE_ALL_REDUCE_BYTES - SMALL_ALL_REDUCE_BYTES) / max(large - small, 1e-9)
    sources = {field: "locojax probe" for field in profile}
    presets = ", ".join(dict.fromkeys(k["preset"] for k in measurements["kernels_pinned"]))
    sources["rates"] = (f"locojax probe: the engine's train step and rollout of {presets} timed on every core at "
                        "once, on cores free of other work (schedstat), fitted per model width")
    return {**profile, "sources": sources}


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
    kernels = sub.add_parser("kernel-worker", help="a process holding compiled engine kernels, timed on request")
    kernels.add_argument("--devices", type=int, default=1)
    kernels.add_argument("--kernels", required=True, help="JSON list of kernels (see kernel_list)")
    kernels.add_argument("--cache-dir", default=None, help="persistent JAX compilation cache shared by the workers")
    kernels.add_argument("--core", type=int, default=None, help="pin this process to one core (before JAX starts)")
    args = parser.parse_args(argv)
    if args.command == "kernel-worker":
        if args.core is not None:
            os.sched_setaffinity(0, [args.core])
        kernel_worker(args.devices, json.loads(args.kernels), args.cache_dir)
        return
    print(json.dumps(all_reduce_worker(args.process_id, args.port, args.iterations)), flush=True)


if __name__ == "__main__":
    _main()
