"""The contention meter: how much other work on a shared machine slowed our processes, from the
kernel scheduler's own per-thread accounting."""

from __future__ import annotations

import os
import time
from typing import Any

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


def thread_schedstats(pids: list[int]) -> dict[tuple[int, int], tuple[int, int]]:
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
    """Run and wait seconds between two `thread_schedstats` snapshots of the threads that carried the
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
        self.snapshots.append((time.monotonic(), thread_schedstats(pids)))

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
