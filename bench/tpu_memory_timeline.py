"""Where a run's device peak comes from, over time (issues 37 and 40: `peak_device_vs_plan`).

    python3 bench/tpu_memory_timeline.py OUT.json WORKLOAD [--steps 4] [--work DIR]
    python3 bench/tpu_memory_timeline.py summarise DIR --out bench/results/tpu_memory_timeline_tpu.json

Runs one workload's CO loop in this process, as `locojax train` runs it, while a thread samples the
device's `memory_stats()` about every millisecond: `bytes_in_use` (live buffers) and `bytes_reserved`
(the runtime's reservation for programs' temporaries, bench/tpu_memory_probe.py), each sample tagged
with what the loop was doing (setup, or the step phase: time/rollout, time/train, ...). The report: per
phase, the highest in-use, reserved and in-use + reserved seen; the runtime's own peak counters at the
end of setup and after each step; the compiled memory plan the run printed, term by term; and the live
arrays after the last step, largest first. The device peak the benchmarks report is
peak_bytes_in_use + peak_bytes_reserved (`locojax.metrics.device_peak_bytes`): two peaks that need not
fall at the same moment, which this tells apart from what is live at once.

Workloads (bench/grpo_step.py's, from the preset's random init, no HF directory):
  lora16, lora64: its `lora` size (Qwen3-1.7B bf16, LoRA rank 16 on every linear layer, 96 + 256
                  tokens) at 16 and 64 rows; lora4b-24: the same at Qwen3-4B, 24 rows (its largest)
  b:              size b (the small preset, float32, 32 prompts x 8, 64 + 128 tokens, kl 0.04)
  c16:            size c (Qwen3-0.6B float32, 96 + 128 tokens, kl 0) at 16 rows
  bf16-128:       bench/scale.py's batch (Qwen3-0.6B bf16, remat full, 16 prompts x 8, 64 + 128 tokens)
One workload per process: the runtime's peak counters cover the process's life.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 2**30


def workloads():
    from bench.grpo_step import SIZES, Workload

    return {
        "lora16": SIZES["lora"].with_prompts(2),
        "lora64": SIZES["lora"],
        "lora4b-24": dataclasses.replace(SIZES["lora"], preset="qwen3-4b", prompts=3),
        "b": SIZES["b"],
        "c16": dataclasses.replace(SIZES["c"], prompts=4, group=4, hf_weights=False),
        "bf16-128": Workload("bf16-128", "qwen3-0.6b", prompts=16, group=8, new_tokens=128, prompt_slots=64,
                             kl_coef=0.0, remat="full", dtype="bfloat16", scale_inputs=True, hf_weights=False),
    }


class Sampler:
    """A thread reading one device's memory statistics, tagged with the loop's current phase."""

    def __init__(self, device, period_s: float = 0.001):
        self.device, self.period_s = device, period_s
        self.phase = "setup"
        self.started = time.perf_counter()
        self.by_phase: dict[str, dict[str, float]] = collections.defaultdict(
            lambda: {"in_use": 0.0, "reserved": 0.0, "sum": 0.0, "samples": 0})
        self.changes: list[tuple[float, str, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = (-1.0, -1.0)
        while not self._stop.is_set():
            stats = self.device.memory_stats() or {}
            in_use, reserved = float(stats.get("bytes_in_use", 0)), float(stats.get("bytes_reserved", 0))
            top = self.by_phase[self.phase]
            top["in_use"] = max(top["in_use"], in_use)
            top["reserved"] = max(top["reserved"], reserved)
            top["sum"] = max(top["sum"], in_use + reserved)
            top["samples"] += 1
            if abs(in_use - last[0]) > 2**20 or abs(reserved - last[1]) > 2**20:
                self.changes.append((time.perf_counter() - self.started, self.phase, in_use / GiB, reserved / GiB))
                last = (in_use, reserved)
            time.sleep(self.period_s)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def phases_tagged(sampler: Sampler):
    """While active, each `PhaseTimer.phase(name)` sets the sampler's phase (the innermost named one)."""
    from locojax import metrics as m

    real_phase = m.PhaseTimer.phase

    @contextlib.contextmanager
    def phase(self, name, *, split=None):
        outer = sampler.phase
        if name is not None:
            sampler.phase = name
        try:
            with real_phase(self, name, split=split) as span:
                yield span
        finally:
            sampler.phase = outer

    m.PhaseTimer.phase = phase
    try:
        yield
    finally:
        m.PhaseTimer.phase = real_phase


class StepCounters:
    """A metric sink: the runtime's counters after each step, and the step's metrics that matter here."""

    def __init__(self, device, sampler: Sampler):
        self.device, self.sampler, self.steps, self.live = device, sampler, [], None

    def write(self, step, host, metrics) -> None:
        from locojax import metrics as m

        if host != m.ALL_HOSTS:
            return
        stats = self.device.memory_stats() or {}
        self.steps.append({"step": step, **{key: stats.get(key, 0) / GiB for key in (
            "bytes_in_use", "peak_bytes_in_use", "bytes_reserved", "peak_bytes_reserved")},
            "device_peak_gib": metrics.get(m.MEMORY_DEVICE_PEAK), "time/step": metrics.get(m.TIME_STEP)})
        self.live = live_arrays_summary()  # while the run's state is alive; the last step's is kept
        self.sampler.phase = f"between steps (after {step})"

    def close(self) -> None:
        pass


def live_arrays_summary(limit: int = 12) -> dict:
    import jax

    arrays = jax.live_arrays()
    by_shape = collections.Counter()
    for array in arrays:
        by_shape[(tuple(array.shape), str(array.dtype))] += array.nbytes
    return {"count": len(arrays), "total_gib": sum(a.nbytes for a in arrays) / GiB,
            "largest": [{"shape": list(shape), "dtype": dtype, "gib": nbytes / GiB}
                        for (shape, dtype), nbytes in by_shape.most_common(limit)]}


def summarise(paths: list[Path]) -> dict:
    """One record per workload from the timelines of `paths`: the compiled plan against the device's
    peak (the runtime's two peak counters added, as `memory/device_peak_gib` reports it), the steady
    in-use bytes, and each program's reservation beside XLA's two figures for it."""
    workloads_out = {}
    for path in paths:
        record = json.loads(path.read_text())
        last = record["after_steps"][-1]
        reservations = []  # the runtime's reservation each time it changed, with the phase it changed in
        for change in record["changes"]:
            if not reservations or change["reserved_gib"] != reservations[-1]["reserved_gib"]:
                reservations.append({"phase": change["phase"], "reserved_gib": change["reserved_gib"]})
        programs = {name: {"temp_size_gib": a["temp_size_in_bytes"],
                           "peak_minus_arguments_gib": a["peak_memory_in_bytes"] - a["argument_size_in_bytes"]}
                    for name, a in record.get("compiled_analyses_gib", {}).items()}
        plan = record["plan"]
        workloads_out[record["workload"]] = {
            "commit": record["commit"], "date_utc": record.get("date_utc"), "rows": record["rows"],
            "status": record["status"], "plan_line": plan["summary"] if plan else None,
            "planned_gib": plan["peak_gib"] if plan else None,
            "peak_device_gib": last["device_peak_gib"],
            "peak_device_vs_plan": (last["device_peak_gib"] / plan["peak_gib"]
                                    if plan and last["device_peak_gib"] else None),
            "peak_in_use_gib": last["peak_bytes_in_use"], "steady_in_use_gib": last["bytes_in_use"],
            "peak_reserved_gib": last["peak_bytes_reserved"],
            "in_use_peak_phase": max(record["changes"], key=lambda c: c["in_use_gib"])["phase"]
            if record["changes"] else None,
            "reservations": reservations, "programs": programs}
    first = json.loads(paths[0].read_text())
    return {"benchmark": "tpu_memory_timeline", "platform": first["platform"], "device_kind": first["device_kind"],
            "commit": sorted({w["commit"] for w in workloads_out.values()}),
            "method": __doc__.split("Workloads")[0].strip(), "workloads": workloads_out}


def main() -> None:
    if sys.argv[1:2] == ["summarise"]:
        parser = argparse.ArgumentParser(description="the timelines of DIR in one file")
        parser.add_argument("command")
        parser.add_argument("folder", type=Path)
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--commit", help="the commit measured, where the timelines name a stale one "
                                             "(a machine's copy of the checkout whose .git was older)")
        parser.add_argument("--note", help="a note to keep with the figures")
        parser.add_argument("--before", type=Path, help="a folder of timelines of the code before a change, "
                                                        "kept beside them as before_workloads")
        args = parser.parse_args()
        summary = summarise(sorted(args.folder.glob("timeline_*.json")))
        if args.before:
            summary["before_workloads"] = summarise(sorted(args.before.glob("timeline_*.json")))["workloads"]
        if args.commit:
            summary["commit"] = args.commit
            for workload in summary["workloads"].values():
                workload["commit"] = args.commit
        if args.note:
            summary["note"] = args.note
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        for name, workload in summary["workloads"].items():
            print(f"{name:10} rows {workload['rows']:4} plan {workload['planned_gib']:.2f} GiB, "
                  f"peak {workload['peak_device_gib']:.2f}: {workload['peak_device_vs_plan']:.3f}")
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("workload", choices=sorted(workloads()))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/locojax-tpu/work"))
    parser.add_argument("--model-preset", help="another preset than the workload's (a CPU dry run: tiny)")
    args = parser.parse_args()

    import jax

    from bench import grpo_step
    from locojax.modes import common
    from locojax.modes.co import run_co

    work = workloads()[args.workload]
    if args.model_preset:
        work = dataclasses.replace(work, preset=args.model_preset)
    args.work.mkdir(parents=True, exist_ok=True)
    inputs = (grpo_step.prepare_scale_inputs(args.work, work.preset, weights=work.hf_weights)
              if work.scale_inputs else None)
    spec = grpo_step.make_spec(work, args.steps, str(args.work / f"timeline-{args.workload}"), inputs)
    device = jax.devices()[0]
    plans = []
    real_check = common.check_compiled_plan

    def check_and_keep(*a, **k):
        plan = real_check(*a, **k)
        plans.append(plan)
        return plan

    common.check_compiled_plan = check_and_keep
    from locojax import compiled_plan as compiled_plan_module

    analyses = {}
    real_compile_all = compiled_plan_module._compile_all

    def compile_all_and_keep(programs):
        found = real_compile_all(programs)
        for name, analysis in found.items():
            analyses[name] = {key: getattr(analysis, key) / GiB for key in dir(analysis)
                              if key.endswith("_in_bytes") and isinstance(getattr(analysis, key), int)}
        return found

    compiled_plan_module._compile_all = compile_all_and_keep
    sampler = Sampler(device)
    counters = StepCounters(device, sampler)
    from bench.scale import source_commit

    record = {"benchmark": "tpu_memory_timeline", "commit": source_commit(),
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "workload": args.workload, "rows": work.rows,
              "spec": json.loads(spec.model_dump_json()), "platform": device.platform,
              "device_kind": device.device_kind, "before": device.memory_stats()}
    sampler.start()
    try:
        with phases_tagged(sampler):
            result = run_co(spec, console=False, extra_sinks=[counters])
    finally:
        sampler.stop()
    record["status"] = str(result.status)
    record["plan"] = ({"summary": plans[0].summary(), "peak_gib": plans[0].peak_bytes / GiB,
                       "terms_gib": {k: v / GiB for k, v in plans[0].terms.items()}} if plans else None)
    record["compiled_analyses_gib"] = analyses  # XLA's memory analysis of each program, every *_in_bytes field
    record["after_steps"] = counters.steps
    record["by_phase_gib"] = {phase: {k: (v / GiB if k != "samples" else v) for k, v in top.items()}
                              for phase, top in sampler.by_phase.items()}
    record["changes"] = [{"t_s": round(t, 4), "phase": phase, "in_use_gib": round(u, 3), "reserved_gib": round(r, 3)}
                         for t, phase, u, r in sampler.changes[:4000]]
    record["live_at_last_step"] = counters.live
    record["final_stats"] = device.memory_stats()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps({"workload": args.workload, "plan_gib": record["plan"] and record["plan"]["peak_gib"],
                      "analyses": analyses,
                      "after_steps": counters.steps[-1] if counters.steps else None,
                      "by_phase_gib": record["by_phase_gib"]}, indent=1, default=str))


if __name__ == "__main__":
    main()
