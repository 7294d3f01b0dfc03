"""Coordination benchmark: CO vs SC vs DA at 1, 2 and 4 host processes, same model and global batch.

    CO  H `locojax host` processes (jax.distributed over gloo), each samples, scores and trains its own
    SC  a controller plus H workers: every completion travels to the controller, which detokenises,
        scores and normalises all of them, then sends each worker its rows of the train step
    DA  H/2 rollout + H/2 train hosts (Ray actors, overlapped, staleness <= 1); needs H >= 2

Each host process is pinned to its share of this machine's cores (wrapping when H > cores: 4 hosts on
2 cores share them two by two, as they would share a smaller slice).

Workloads:
    host_heavy     MATH-style problems whose answers are LaTeX fractions, scored by the `math` reward
                   (math-verify: LaTeX -> sympy, symbolic equivalence) on every completion. The policy is
                   first warm-started by SFT on the same problems, so its completions end in a
                   `\\boxed{...}` that math-verify really parses (an untrained policy emits no box and the
                   reward would cost nothing): many samples, real host CPU per sample
    rollout_heavy  GSM8K-style prompts with long generations: decode dominates the step

For each (workload, hosts, mode): median step time over the steady-state steps (all but the first
WARMUP_STEPS, which compile and warm the reward's caches up, and the last one, which saves the final
checkpoint), the median of that over
`--rounds` runs with the run-to-run spread, and the device/host/network split, plus the ratios co_vs_sc
(SC step / CO step) and da_vs_co (CO step / DA step; > 1 means DA is faster) per host count, and
per run the hosts' spread in rollout, reward and train time (`host_spread`: the slowest host, the
mean host and the wait for the straggler, which the placement model has no term for yet).
Writes bench/results/coordination.json; the last line printed is `co_vs_sc_host_heavy_max_hosts=<x>`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from math import gcd
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "coordination.json"
HOST_COUNTS = (1, 2, 4)

WORKLOADS = {
    "host_heavy": {
        "task": {"name": "math", "reward": ["math"]},
        "rollout": {"prompts_per_step": 32, "group_size": 8, "max_prompt_tokens": 144, "max_new_tokens": 48,
                    "temperature": 1.0},
        "data": "math_like.jsonl", "warm_start": True,
    },
    "rollout_heavy": {
        "task": {"name": "gsm8k", "reward": ["gsm8k", "gsm8k_flexible", "format"]},
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_prompt_tokens": 96, "max_new_tokens": 192,
                    "temperature": 1.0},
        "data": "gsm8k_like.jsonl", "warm_start": False,
    },
}
MODE_NAMES = ("co", "sc", "da")
# Kept for bench/placement_accuracy.py: the 2-host placements it was built on.
MODES = {mode: {"mode": mode, "hosts": 2, "devices_per_host": 1, **({"rollout_fraction": 0.5} if mode == "da" else {})}
         for mode in MODE_NAMES}
SPLIT_KEYS = ("time/step", "time/device", "time/host", "time/network", "time/rollout", "time/reward",
              "time/train", "time/weight_sync", "completion/len_mean")
SFT_STEPS = 300
# Steps left out at the front of every run's medians. Steps 0-1 compile. The steps after them still
# warm up: the `math` reward (math-verify: LaTeX -> sympy) fills each process's parser and sympy caches
# on its first few hundred answers, so a host that scores 64 samples a step (4 hosts) pays that cost
# over more steps than one that scores 256 (1 host): in one 12-step run here, 4-host CO's reward time
# (summed over hosts) on steps 2-5 was 1.8-5x that of its later steps. A run of thousands of steps
# never sees it, so the benchmark measures after it.
WARMUP_STEPS = 4


def placement(mode: str, hosts: int) -> dict | None:
    """The placement of `mode` on `hosts` host processes, or None where the mode cannot run (DA on 1)."""
    if mode == "da" and hosts < 2:
        return None
    return {"mode": mode, "hosts": hosts, "devices_per_host": 1, **({"rollout_fraction": 0.5} if mode == "da" else {})}


def write_gsm8k_like(path: Path, count: int = 2000, seed: int = 0) -> None:
    """Synthetic problems in the GSM8K release format (`question`, `answer` ending in `#### N`)."""
    rng = random.Random(seed)
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark"]
    things = ["clips", "dollars", "pages", "cookies", "marbles", "stickers", "apples", "books"]
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            name, thing = rng.choice(names), rng.choice(things)
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            question = (f"{name} had {a} {thing} in April and then {b} more {thing} in May. "
                        f"How many {thing} did {name} have altogether in April and May?")
            answer = f"{name} had {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n#### {a + b}"
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")


def write_math_like(path: Path, count: int = 2000, seed: int = 0) -> None:
    """Synthetic problems in the MATH release format (`problem`, `solution` ending in a boxed answer):
    sums of two fractions, whose answers are reduced LaTeX fractions math-verify compares symbolically."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
            numerator, denominator = a * d + c * b, b * d
            common = gcd(numerator, denominator)
            p, q = numerator // common, denominator // common
            answer = str(p) if q == 1 else f"\\frac{{{p}}}{{{q}}}"
            problem = f"Compute $\\frac{{{a}}}{{{b}}}+\\frac{{{c}}}{{{d}}}$."
            solution = f"$\\frac{{{numerator}}}{{{denominator}}}=\\boxed{{{answer}}}$"
            f.write(json.dumps({"problem": problem, "solution": solution}) + "\n")


def _train(spec: dict, workdir: Path, timeout_s: float = 1800) -> None:
    spec_path = workdir / f"{spec['name']}.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "locojax.cli", "train", str(spec_path), "--quiet"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{spec['name']} failed:\n{done.stderr[-4000:]}")


def prepare(workdir: Path, workloads=tuple(WORKLOADS)) -> dict[str, dict]:
    """Each workload's data file, and for a warm-started one the SFT model every mode's runs start from
    (one SFT run, before any measurement); returns what `run_mode` needs per workload."""
    writers = {"math_like.jsonl": write_math_like, "gsm8k_like.jsonl": write_gsm8k_like}
    prepared = {}
    for workload in workloads:
        entry = WORKLOADS[workload]
        data = workdir / entry["data"]
        if not data.exists():
            writers[entry["data"]](data)
        model = {"preset": "tiny"}
        if entry["warm_start"]:
            out = workdir / f"{workload}-sft"
            if not (out / "model").exists():
                rollout = {**entry["rollout"], "prompts_per_step": 64}
                _train({"name": f"{workload}-sft", "kind": "sft", "seed": 0, "model": {"preset": "tiny"},
                        "task": {**entry["task"], "path": str(data)}, "rollout": rollout,
                        "optim": {"lr": 1e-3, "warmup_steps": 10, "decay": "constant"}, "steps": SFT_STEPS,
                        "placement": {"mode": "co", "hosts": 1, "devices_per_host": 1},
                        "checkpoint": {"every": 0}, "output_dir": str(out)}, workdir)
            model = {"preset": "tiny", "checkpoint": str(out / "model")}
        prepared[workload] = {"data": data, "model": model}
    return prepared


def run_mode(workdir: Path, workload: str, mode: str, steps: int, prepared: dict, keep_records: bool = False,
             hosts: int = 2) -> dict:
    """Train one (workload, mode, hosts) run in a subprocess; its medians, plus its spec and metric records
    when `keep_records` (bench/placement_accuracy.py predicts and calibrates from them)."""
    name = f"{workload}-{mode}-{hosts}h"
    where = placement(mode, hosts)
    assert where is not None, (mode, hosts)
    spec = {"name": name, "seed": 0, "model": prepared[workload]["model"],
            "task": {**WORKLOADS[workload]["task"], "path": str(prepared[workload]["data"])},
            "rollout": WORKLOADS[workload]["rollout"],
            "optim": {"lr": 1e-4, "warmup_steps": 0}, "steps": steps,
            "placement": where, "checkpoint": {"every": 0},
            "output_dir": str(workdir / name)}
    start = time.perf_counter()
    _train(spec, workdir)
    rows = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    # Steps before WARMUP_STEPS compile or warm the reward up; the last step also saves the run's final
    # checkpoint (0.5-0.8 s here), which is not a steady-state step either.
    steady = [r for r in rows if r["host"] == "all" and WARMUP_STEPS <= r["step"] < steps - 1]
    summary = {key: statistics.median(r.get(key, 0.0) for r in steady) for key in SPLIT_KEYS}
    summary["median_step_s"] = summary["time/step"]
    summary["steps_measured"] = len(steady)
    summary["host_spread"] = host_spread(rows, {r["step"] for r in steady})
    summary["wall_s"] = time.perf_counter() - start
    summary["settings"] = {"model": spec["model"], **WORKLOADS[workload]["rollout"], "placement": where}
    if keep_records:
        summary["spec"], summary["records"] = spec, rows
    return summary


HOST_SPREAD_KEYS = ("time/rollout", "time/reward", "time/train")


def host_spread(rows: list[dict], steps: set[int]) -> dict[str, dict[str, float]]:
    """How far the hosts of one run were apart, per phase, over the steady steps: the median over
    steps of the slowest host's time, of the mean host's, and of their difference (what a synchronous
    step waits for the straggler). Only hosts that report the phase count; {} for a single host."""
    by_step: dict[int, list[dict]] = {}
    for row in rows:
        if row["host"] != "all" and row["step"] in steps:
            by_step.setdefault(row["step"], []).append(row)
    spreads = {}
    for key in HOST_SPREAD_KEYS:
        slowest, mean = [], []
        for hosts in by_step.values():
            values = [h[key] for h in hosts if h.get(key)]
            if len(values) > 1:
                slowest.append(max(values))
                mean.append(statistics.fmean(values))
        if slowest:
            spreads[key] = {"slowest_s": statistics.median(slowest), "mean_s": statistics.median(mean),
                            "straggler_s": statistics.median(s - m for s, m in zip(slowest, mean)),
                            "hosts": max(len(h) for h in by_step.values())}
    return spreads


def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the rounds of one configuration landed."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12,
                        help=f"steps per run; medians over steps {WARMUP_STEPS} .. steps-2 (default 12)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every (workload, hosts, mode), in alternating mode order; medians over rounds")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--hosts", nargs="*", type=int, default=list(HOST_COUNTS))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    # Measured, not assumed: the cores this process (and the runs it starts) may use, and the machine's.
    machine = {"cores": len(os.sched_getaffinity(0)), "cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]}
    results: dict = {"machine": machine, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                     "measured_steps": [WARMUP_STEPS, args.steps - 2], "rounds": args.rounds, "host_counts": args.hosts,
                     "sft_steps": SFT_STEPS, "workloads": {}}
    runs: dict[tuple[str, int, str], list[dict]] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepare(Path(tmp), args.workloads)
        for round_index in range(args.rounds):
            # The same run moves by up to ~20% between runs on this machine: alternate the order so that
            # no mode always runs first (or right after the heaviest one).
            order = list(MODE_NAMES) if round_index % 2 == 0 else list(reversed(MODE_NAMES))
            workdir = Path(tmp) / f"round{round_index}"
            workdir.mkdir(exist_ok=True)
            for workload in args.workloads:
                for hosts in args.hosts:
                    for mode in order:
                        if placement(mode, hosts) is None:
                            continue
                        loads.append(os.getloadavg()[0])
                        run = run_mode(workdir, workload, mode, args.steps, prepared, hosts=hosts)
                        runs.setdefault((workload, hosts, mode), []).append(run)
                        print(f"round {round_index} {workload:<14}{hosts}h {mode:<3} {run['median_step_s']:.3f} s",
                              flush=True)
    for workload in args.workloads:
        per_hosts = {}
        for hosts in args.hosts:
            modes = {}
            for mode in MODE_NAMES:
                mine = runs.get((workload, hosts, mode))
                if not mine:
                    continue
                steps = [r["median_step_s"] for r in mine]
                modes[mode] = {**{key: statistics.median(r[key] for r in mine) for key in SPLIT_KEYS},
                               "settings": mine[0]["settings"], "spread": spread(steps),
                               "host_spread_per_round": [r["host_spread"] for r in mine],
                               "rounds": [{key: r[key] for key in ("median_step_s", "steps_measured", "wall_s")}
                                          for r in mine]}
                modes[mode]["median_step_s"] = modes[mode]["time/step"]
            entry = {"modes": modes,
                     "co_vs_sc": modes["sc"]["median_step_s"] / modes["co"]["median_step_s"],
                     "co_vs_sc_per_round": [sc["median_step_s"] / co["median_step_s"]
                                            for co, sc in zip(modes["co"]["rounds"], modes["sc"]["rounds"])]}
            if "da" in modes:
                entry["da_vs_co"] = modes["co"]["median_step_s"] / modes["da"]["median_step_s"]
            per_hosts[str(hosts)] = entry
        results["workloads"][workload] = {"hosts": per_hosts,
                                          "co_vs_sc": {h: e["co_vs_sc"] for h, e in per_hosts.items()},
                                          "da_vs_co": {h: e["da_vs_co"] for h, e in per_hosts.items() if "da_vs_co" in e}}
    machine["load_avg_1m_end"] = os.getloadavg()[0]
    machine["load_avg_1m_max_before_a_run"] = max(loads) if loads else None
    host_heavy = results["workloads"].get("host_heavy")
    if host_heavy:
        top = str(max(args.hosts))
        results["co_vs_sc_host_heavy_max_hosts"] = host_heavy["co_vs_sc"][top]
        results["max_hosts"] = int(top)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"{'workload':<14}{'hosts':>6} {'mode':<5}{'step s':>8}{'device':>8}{'host':>8}{'network':>9}{'spread':>8}")
    for workload, entry in results["workloads"].items():
        for hosts, at in entry["hosts"].items():
            for mode, s in at["modes"].items():
                print(f"{workload:<14}{hosts:>6} {mode:<5}{s['time/step']:>8.3f}{s['time/device']:>8.3f}"
                      f"{s['time/host']:>8.3f}{s['time/network']:>9.3f}{s['spread']:>8.2f}")
            print(f"{workload:<14}{hosts:>6} co_vs_sc={at['co_vs_sc']:.2f}"
                  + (f" da_vs_co={at['da_vs_co']:.2f}" if "da_vs_co" in at else ""))
    if host_heavy:
        print(f"co_vs_sc_host_heavy_max_hosts={results['co_vs_sc_host_heavy_max_hosts']:.2f}")


if __name__ == "__main__":
    main()
