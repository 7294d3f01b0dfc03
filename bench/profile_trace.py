"""A jax.profiler trace of a few steady steps of the engine, and what it says: the share of the steps'
wall time with no op running on the device (`device_idle_fraction`) and the ops that took the time.

Recording (in the process that runs the engine, e.g. bench/grpo_step.py's side or bench/scale.py's
profile run):
  * `annotated_phases()` makes every `PhaseTimer.phase` of the run loop also a `TraceAnnotation`
    named `phase:<metric name>` (`phase:time/rollout`, ...), so the trace shows the host's phases;
  * `ProfiledSteps(trace_dir, first_step, steps)` is a metric sink: after the aggregate record of step
    `first_step - 1` it starts the trace and marks a boundary, after each record up to that of
    `first_step + steps - 1` it marks one more, then stops. Between the first and last marks lie
    exactly `steps` whole step periods, measured as the benchmarks measure a step (from one step's
    record to the next); starting and stopping the profiler happen outside them.

Reading (`summarise_trace`, pure Python over `jax.profiler.ProfileData`, runs anywhere): op events
come from the device planes' "XLA Ops" line where the trace has a device plane (a TPU's
`/device:TPU:0`), else from the host plane's events that carry an `hlo_op` stat (XLA:CPU runs its
ops, thunk by thunk, on host threads). The busy time is the union of their intervals inside the
window between the two marks, so ops running side by side on several threads count once;
`device_idle_fraction` = 1 - busy / window. Top ops are ranked by self time (an op's time less that
of ops nested in it on the same line, so a while loop does not count its body twice), overall and
per host phase (an op belongs to the phase whose annotation holds its start; phases sync on their
device results, so an op dispatched in one finishes there), by op and by kind of op (`op_kind`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import glob
import os
from typing import Iterator

BOUNDARY = "locojax_bench_step_boundary"
PHASE_PREFIX = "phase:"
OPS_LINE, MODULES_LINE = "XLA Ops", "XLA Modules"
HOST_MARK_PREFIXES = ("dispatch", "wait", "host")  # the engine's TraceAnnotations (locojax/modes/co.py)
OUTSIDE_PHASES = "outside phases"


@contextlib.contextmanager
def annotated_phases() -> Iterator[None]:
    """While active, each `PhaseTimer.phase(name)` is also a profiler TraceAnnotation `phase:<name>`
    (a few microseconds a phase when no trace is being recorded)."""
    import jax

    from locojax import metrics as m

    real_phase = m.PhaseTimer.phase

    @contextlib.contextmanager
    def phase(self, name, *, split=None):
        if name is None:
            with real_phase(self, name, split=split) as span:
                yield span
            return
        with jax.profiler.TraceAnnotation(PHASE_PREFIX + name), real_phase(self, name, split=split) as span:
            yield span

    m.PhaseTimer.phase = phase
    try:
        yield
    finally:
        m.PhaseTimer.phase = real_phase


def mark_boundary(step: int) -> None:
    import jax

    with jax.profiler.TraceAnnotation(BOUNDARY, step=step):
        pass


# What the trace records beside the device's ops. JAX's default also traces every Python call on the
# host (python_tracer_level 1), which slowed the host ~3x in the traced steps at size a (TPU, a73e95c:
# 15 ms from the train phase's start to the rollout's dispatch, 4.5 ms under cProfile) and so made the
# device look idle for the tracer's own time. The idle fraction needs the device's ops, the host's
# phase annotations and the step marks (host TraceMes, level >= 1) only; cProfile says where the host's
# Python time goes (HostProfiledSteps).
TRACE_OPTIONS = {"python_tracer_level": 0, "host_tracer_level": 2}


def trace_options():
    import jax

    options = jax.profiler.ProfileOptions()
    for name, value in TRACE_OPTIONS.items():
        setattr(options, name, value)
    return options


class ProfiledSteps:
    """A metric sink that traces steps `first_step` .. `first_step + steps - 1` into `trace_dir`.

    The trace starts `lead_in` steps before the first marked one: `jax.profiler.start_trace` takes the
    host tens of milliseconds, while the next step's rollout, dispatched ahead, runs on. Started right
    before the first marked step (as up to d3ba2c1), that step began after its rollout had ended and
    its start showed the chip idle for the profiler's own time (a TPU trace at size a: ~4.5 ms of idle
    in the first marked step, none of it in the two after it). The lead-in step is in the trace but not
    between the marks."""

    def __init__(self, trace_dir: str, first_step: int, steps: int, lead_in: int = 1):
        if steps < 1 or lead_in < 0 or first_step < 1 + lead_in:
            raise ValueError("profile at least one step, after the first (which compiles) and the lead-in steps")
        self.trace_dir, self.first_step, self.steps, self.lead_in = trace_dir, first_step, steps, lead_in
        self.tracing = False
        self.traced = False

    def write(self, step, host, metrics) -> None:
        from locojax import metrics as m

        if host != m.ALL_HOSTS:
            return
        import jax

        if step == self.first_step - 1 - self.lead_in and not self.traced:
            jax.profiler.start_trace(self.trace_dir, profiler_options=trace_options())
            self.tracing = True
        if self.tracing and step >= self.first_step - 1:
            mark_boundary(step)
            if step == self.first_step + self.steps - 1:
                self.stop()

    def stop(self) -> None:
        if self.tracing:
            import jax

            jax.profiler.stop_trace()
            self.tracing, self.traced = False, True

    def close(self) -> None:
        self.stop()


class HostProfiledSteps:
    """A metric sink that runs steps `first_step` .. `first_step + steps - 1` under cProfile (the run
    loop's thread only: reward threads and XLA's own threads are not in it), where the device trace
    cannot say what the host did while the device waited: which Python calls a steady step spends its
    wall time in. cProfile slows Python itself, so these steps are never the timed ones."""

    def __init__(self, first_step: int, steps: int, top: int = 30):
        if first_step < 1 or steps < 1:
            raise ValueError("profile at least one step, after the first (which compiles)")
        self.first_step, self.steps, self.top = first_step, steps, top
        self.profiler = None
        self.started = self.wall_s = None

    def write(self, step, host, metrics) -> None:
        import cProfile
        import time

        from locojax import metrics as m

        if host != m.ALL_HOSTS:
            return
        if step == self.first_step - 1 and self.profiler is None:
            self.profiler = cProfile.Profile()
            self.started = time.perf_counter()
            self.profiler.enable()
        elif self.profiler is not None and self.wall_s is None and step == self.first_step + self.steps - 1:
            self.profiler.disable()
            self.wall_s = time.perf_counter() - self.started

    def close(self) -> None:
        if self.profiler is not None and self.wall_s is None:
            self.profiler.disable()

    def summary(self) -> dict | None:
        """Per profiled step: the wall time, and the top functions by self time and by cumulative time
        (seconds per step; `calls` per step), named `file:line(function)` with the path cut to its last
        two parts."""
        import pstats

        if self.profiler is None or self.wall_s is None:
            return None
        stats = pstats.Stats(self.profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)

        def name(key) -> str:
            file, line, function = key
            return f"{'/'.join(file.split('/')[-2:])}:{line}({function})" if line else function

        def ranked(index: int) -> list[dict]:
            keys = sorted(stats, key=lambda k: stats[k][index], reverse=True)[: self.top]
            return [{"function": name(k), "calls_per_step": stats[k][1] / self.steps,
                     "self_s_per_step": stats[k][2] / self.steps, "cumulative_s_per_step": stats[k][3] / self.steps}
                    for k in keys]

        return {"steps": self.steps, "wall_s_per_step": self.wall_s / self.steps,
                "by_self_time": ranked(2), "by_cumulative_time": ranked(3),
                "method": "cProfile over the run loop's thread for whole steps after the timed and traced ones; "
                          "cProfile's own overhead inflates Python-heavy calls"}


@dataclasses.dataclass
class OpEvent:
    start_ns: float
    end_ns: float
    self_ns: float
    name: str
    module: str
    category: str
    line: str


def trace_file(trace_dir: str) -> str:
    """The newest `*.xplane.pb` jax.profiler wrote under `trace_dir`."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    return max(files, key=os.path.getmtime)


def _stats(event) -> dict:
    return {key: value for key, value in event.stats}


def _self_times(events: list) -> list[float]:
    """Each event's duration less that of the events nested directly in it (one line's events nest or
    follow each other)."""
    order = sorted(range(len(events)), key=lambda i: (events[i].start_ns, -events[i].duration_ns))
    self_ns = [float(e.duration_ns) for e in events]
    stack: list[int] = []
    for i in order:
        start = events[i].start_ns
        while stack and events[stack[-1]].start_ns + events[stack[-1]].duration_ns <= start:
            stack.pop()
        if stack:
            self_ns[stack[-1]] -= events[i].duration_ns
        stack.append(i)
    return [max(value, 0.0) for value in self_ns]


def _module_lookup(line) -> tuple[list[float], list[tuple[float, str]]]:
    spans = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events)
    return [s[0] for s in spans], [(s[1], s[2]) for s in spans]


def op_events(profile) -> tuple[list[OpEvent], dict]:
    """The trace's op executions and where they were read from (`source`: planes and lines)."""
    ops: list[OpEvent] = []
    device_planes = [plane for plane in profile.planes if plane.name.startswith("/device:")
                     and any(line.name == OPS_LINE for line in plane.lines)]
    if device_planes:
        used = []
        for plane in device_planes:
            modules = next((_module_lookup(line) for line in plane.lines if line.name == MODULES_LINE), ([], []))
            for line in plane.lines:
                if line.name != OPS_LINE:
                    continue
                events = list(line.events)
                for event, self_ns in zip(events, _self_times(events)):
                    stats = _stats(event)
                    module = stats.get("hlo_module")
                    if module is None and modules[0]:
                        index = bisect.bisect_right(modules[0], event.start_ns) - 1
                        if index >= 0 and event.start_ns < modules[1][index][0]:
                            module = modules[1][index][1]
                    ops.append(OpEvent(event.start_ns, event.start_ns + event.duration_ns, self_ns, event.name,
                                       str(module or ""), str(stats.get("hlo_category", "")),
                                       f"{plane.name} / {line.name}"))
            used.append({"plane": plane.name, "lines": sorted({line.name for line in plane.lines})})
        return ops, {"kind": "device plane", "op_line": OPS_LINE, "planes": used}
    lines_used = set()
    for plane in profile.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            events = [e for e in line.events if "hlo_op" in _stats(e)]
            if not events:
                continue
            lines_used.add(f"{plane.name} / {line.name.split('/')[0]}")
            for event, self_ns in zip(events, _self_times(events)):
                stats = _stats(event)
                ops.append(OpEvent(event.start_ns, event.start_ns + event.duration_ns, self_ns, event.name,
                                   str(stats.get("hlo_module", "")), "", f"{plane.name} / {line.name}"))
    return ops, {"kind": "host plane (events with an hlo_op stat: XLA:CPU thunks on host threads)",
                 "lines": sorted(lines_used)}


def host_events(profile, predicate) -> list:
    return [event for plane in profile.planes if plane.name.startswith("/host:")
            for line in plane.lines for event in line.events if predicate(event.name)]


def union_ns(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def op_kind(op: OpEvent) -> str:
    """What kind of op this is: its HLO category where the trace has one (a TPU's), else its name
    without the instance number (`fusion.12` -> `fusion`)."""
    if op.category:
        return op.category
    base, _, number = op.name.rpartition(".")
    return base if base and number.isdigit() else op.name


def top_kinds(ops: list[OpEvent], top: int) -> list[dict]:
    """Self time per op kind (`op_kind`), largest first: total ms, count, share of all op time."""
    groups: dict[str, list[float]] = {}
    for op in ops:
        entry = groups.setdefault(op_kind(op), [0.0, 0])
        entry[0] += op.self_ns
        entry[1] += 1
    total = sum(entry[0] for entry in groups.values()) or 1.0
    return [{"kind": kind, "total_ms": entry[0] / 1e6, "count": entry[1], "share": entry[0] / total}
            for kind, entry in sorted(groups.items(), key=lambda item: -item[1][0])[:top]]


def top_ops(ops: list[OpEvent], top: int) -> list[dict]:
    """Ops grouped by (module, name), largest self time first: total ms, count, share of all op time."""
    groups: dict[tuple[str, str], list[float]] = {}
    categories: dict[tuple[str, str], str] = {}
    for op in ops:
        key = (op.module, op.name)
        entry = groups.setdefault(key, [0.0, 0])
        entry[0] += op.self_ns
        entry[1] += 1
        categories[key] = op.category
    total = sum(entry[0] for entry in groups.values()) or 1.0
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
    return [{"name": name, "module": module, **({"category": categories[(module, name)]}
                                                 if categories[(module, name)] else {}),
             "total_ms": entry[0] / 1e6, "count": entry[1], "share": entry[0] / total}
            for (module, name), entry in ranked]


def program_breakdown(profile, ops: list[OpEvent], phases: list[tuple[float, float, str]],
                      window: tuple[float, float], marks: list[float], steps: int) -> dict | None:
    """Where the idle time lies, from the device's "XLA Modules" line (a TPU trace has one; XLA:CPU's
    does not, then None): between programs (no program running: the device waits on the host) or
    inside them (a program runs, no op: gaps between its ops, e.g. a decode loop's small ops); per
    program, its runs, wall and op-busy time a step; and the last step's timeline of host phases and
    device programs (ms from that step's start mark)."""
    start, end = window
    spans = []
    for plane in profile.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name == MODULES_LINE:
                spans += [(max(e.start_ns, start), min(e.start_ns + e.duration_ns, end), e.name)
                          for e in line.events if e.start_ns + e.duration_ns > start and e.start_ns < end]
    if not spans:
        return None
    spans.sort()
    in_programs = union_ns([(a, b) for a, b, _ in spans])
    busy = union_ns([(max(op.start_ns, start), min(op.end_ns, end)) for op in ops])
    per_program: dict[str, dict] = {}
    op_starts = sorted((op.start_ns, op.end_ns) for op in ops)
    keys = [o[0] for o in op_starts]
    for a, b, name in spans:
        entry = per_program.setdefault(name.split("(")[0], {"runs": 0, "wall_ns": 0.0, "op_busy_ns": 0.0})
        entry["runs"] += 1
        entry["wall_ns"] += b - a
        inside = op_starts[bisect.bisect_left(keys, a):bisect.bisect_left(keys, b)]
        entry["op_busy_ns"] += union_ns([(x, min(y, b)) for x, y in inside])
    last_start, last_end = marks[-2], marks[-1]
    # The engine's own host annotations inside the phases (CO's "dispatch:train", "wait:rollout tokens", ...).
    marked = [(e.start_ns, e.start_ns + e.duration_ns, e.name)
              for e in host_events(profile, lambda name: name.split(":")[0] in HOST_MARK_PREFIXES)]
    timeline = sorted([(a, b, f"phase {n}") for a, b, n in phases if last_start <= a < last_end]
                      + [(a, b, f"host {n}") for a, b, n in marked if last_start <= a < last_end]
                      + [(a, b, f"device {n.split('(')[0]}") for a, b, n in spans if last_start <= a < last_end])
    return {
        "idle_between_programs_s_per_step": (end - start - in_programs) / 1e9 / steps,
        "idle_inside_programs_s_per_step": max(in_programs - busy, 0.0) / 1e9 / steps,
        "per_program": {name: {"runs_per_step": e["runs"] / steps, "wall_ms_per_step": e["wall_ns"] / 1e6 / steps,
                               "op_busy_ms_per_step": e["op_busy_ns"] / 1e6 / steps}
                        for name, e in sorted(per_program.items(), key=lambda item: -item[1]["wall_ns"])},
        "last_step_timeline_ms": [{"what": what, "start_ms": round((a - last_start) / 1e6, 3),
                                   "end_ms": round((b - last_start) / 1e6, 3)} for a, b, what in timeline[:80]],
        "last_step_ms": (last_end - last_start) / 1e6,
    }


def summarise_trace(trace_dir: str, top: int = 15) -> dict:
    """`device_idle_fraction` of the window between the trace's first and last boundary marks, the
    ops' busy time there, and the top ops overall and per host phase."""
    from jax.profiler import ProfileData

    path = trace_file(trace_dir)
    profile = ProfileData.from_file(path)
    marks = sorted(event.start_ns for event in host_events(profile, lambda name: name == BOUNDARY))
    if len(marks) < 2:
        raise ValueError(f"{path} holds {len(marks)} '{BOUNDARY}' marks; a window needs 2")
    host_start, host_end = window_start, window_end = marks[0], marks[-1]
    ops, source = op_events(profile)
    if not ops:
        raise ValueError(f"{path}: no op events (source {source})")
    inside = [op for op in ops if op.end_ns > window_start and op.start_ns < window_end]
    window = window_end - window_start
    if inside:
        alignment = "device ops clipped to the host marks' window (one clock)"
    else:
        # The device's clock is not the host's here: the trace starts at the first mark and stops right
        # after the last, with every step's device work synced inside, so all its ops are the window's.
        inside = ops
        window_start, window_end = min(op.start_ns for op in ops), min(op.start_ns for op in ops) + window
        alignment = (f"no device op between the host marks: device and host clocks differ here, so all "
                     f"{len(ops)} ops of the trace are taken over the host window's length")
    busy = min(union_ns([(max(op.start_ns, window_start), min(op.end_ns, window_end)) for op in inside]), window)
    phases = sorted((event.start_ns, event.start_ns + event.duration_ns, event.name[len(PHASE_PREFIX):])
                    for event in host_events(profile, lambda name: name.startswith(PHASE_PREFIX))
                    if host_start <= event.start_ns < host_end)
    by_phase: dict[str, list[OpEvent]] = {}
    for op in inside:
        # The innermost phase holding the op's start (phases nest: the train phase holds its reference pass).
        holding = [p for p in phases if p[0] <= op.start_ns < p[1]]
        name = min(holding, key=lambda p: p[1] - p[0])[2] if holding else OUTSIDE_PHASES
        by_phase.setdefault(name, []).append(op)
    steps = len(marks) - 1
    programs = program_breakdown(profile, inside, phases, (window_start, window_end), marks, steps)
    return {
        "device_idle_fraction": 1.0 - busy / window,
        "window_s": window / 1e9, "steps": steps, "busy_s": busy / 1e9,
        "op_events": len(inside), "source": source, "trace_file": os.path.basename(path), "alignment": alignment,
        "trace_options": TRACE_OPTIONS,
        "phase_wall_s_per_step": {name: sum(p[1] - p[0] for p in phases if p[2] == name) / 1e9 / steps
                                  for name in sorted({p[2] for p in phases})},
        "top_ops": top_ops(inside, top),
        "top_kinds": top_kinds(inside, top),
        "top_ops_by_phase": {name: {"op_self_s_per_step": sum(op.self_ns for op in group) / 1e9 / steps,
                                    "top_ops": top_ops(group, top), "top_kinds": top_kinds(group, top)}
                             for name, group in sorted(by_phase.items())},
        **({"programs": programs} if programs else {}),
        "method": ("idle = 1 - union of op intervals / window; window = the steps between the first and last "
                   f"'{BOUNDARY}' marks (whole step periods); top ops by self time, share of the op time of "
                   "their group; an op's phase is the innermost 'phase:' annotation holding its start"),
    }
