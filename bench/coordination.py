"""Coordination benchmark: CO vs SC vs DA on this machine's cores (2 here), same model and global batch.

    CO  2 hosts x 1 core   (two `locojax host` processes, jax.distributed over gloo)
    SC  1 controller owning 2 devices (one process; every rollout gathered and scored there)
    DA  1 rollout host + 1 train host (Ray actors, overlapped, staleness <= 1)

Workloads:
    host_heavy     GSM8K-style prompts and reward parsing (strict, flexible, format), short
                   generations: many samples, little device work per sample
    rollout_heavy  long generations: decode dominates the step

For each: median step time over the steady-state steps (all but the two compiling steps and the last
one, which saves the final checkpoint), the median of that over `--rounds` runs, and the
device/host/network split, plus the ratios co_vs_sc (SC step / CO step) and da_vs_co (CO step / DA step; > 1 means DA is faster).
Writes bench/results/coordination.json; the last line printed is `co_vs_sc_host_heavy=<x>`.
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
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "coordination.json"

WORKLOADS = {
    "host_heavy": {
        "task": {"name": "gsm8k", "reward": ["gsm8k", "gsm8k_flexible", "format"]},
        "rollout": {"prompts_per_step": 64, "group_size": 16, "max_prompt_tokens": 96, "max_new_tokens": 8,
                    "temperature": 1.0},
    },
    "rollout_heavy": {
        "task": {"name": "gsm8k", "reward": ["gsm8k", "gsm8k_flexible", "format"]},
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_prompt_tokens": 96, "max_new_tokens": 192,
                    "temperature": 1.0},
    },
}
MODES = {
    "co": {"mode": "co", "hosts": 2, "devices_per_host": 1},
    "sc": {"mode": "sc", "hosts": 2, "devices_per_host": 1},
    "da": {"mode": "da", "hosts": 2, "devices_per_host": 1, "rollout_fraction": 0.5},
}
SPLIT_KEYS = ("time/step", "time/device", "time/host", "time/network", "time/rollout", "time/reward",
              "time/train", "time/weight_sync")


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


def run_mode(workdir: Path, workload: str, mode: str, steps: int, data: Path, keep_records: bool = False) -> dict:
    """Train one (workload, mode) run in a subprocess; its medians, plus its spec and metric records
    when `keep_records` (bench/placement_accuracy.py predicts and calibrates from them)."""
    name = f"{workload}-{mode}"
    spec = {"name": name, "seed": 0, "model": {"preset": "tiny"},
            "task": {**WORKLOADS[workload]["task"], "path": str(data)},
            "rollout": WORKLOADS[workload]["rollout"],
            "optim": {"lr": 1e-4, "warmup_steps": 0}, "steps": steps,
            "placement": MODES[mode], "checkpoint": {"every": 0},
            "output_dir": str(workdir / name)}
    spec_path = workdir / f"{name}.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    command = [sys.executable, "-m", "locojax.cli", "train", str(spec_path), "--quiet"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    # Steps 0-1 compile; the last step also saves the run's final checkpoint (0.5-0.8 s here), which
    # is not a steady-state step either.
    steady = [r for r in rows if r["host"] == "all" and 2 <= r["step"] < steps - 1]
    summary = {key: statistics.median(r.get(key, 0.0) for r in steady) for key in SPLIT_KEYS}
    summary["median_step_s"] = summary["time/step"]
    summary["steps_measured"] = len(steady)
    summary["wall_s"] = time.perf_counter() - start
    summary["settings"] = {"model": "tiny", **WORKLOADS[workload]["rollout"], "placement": MODES[mode]}
    if keep_records:
        summary["spec"], summary["records"] = spec, rows
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every (workload, mode), in alternating mode order; medians are over rounds")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    # Measured, not assumed: the cores this process (and the runs it starts) may use, and the machine's.
    machine = {"cores": len(os.sched_getaffinity(0)), "cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]}
    results: dict = {"machine": machine, "steps": args.steps, "rounds": args.rounds, "workloads": {}}
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "gsm8k_like.jsonl"
        write_gsm8k_like(data)
        for round_index in range(args.rounds):
            # The same run moves by up to ~20% between runs on this machine: alternate the order so that
            # no mode always runs first (or right after the heaviest one).
            order = list(MODES) if round_index % 2 == 0 else list(reversed(MODES))
            for workload in args.workloads:
                workdir = Path(tmp) / f"round{round_index}"
                workdir.mkdir(exist_ok=True)
                for mode in order:
                    runs.setdefault((workload, mode), []).append(run_mode(workdir, workload, mode, args.steps, data))
    for workload in args.workloads:
        modes = {}
        for mode in MODES:
            mine = runs[(workload, mode)]
            modes[mode] = {**{key: statistics.median(r[key] for r in mine) for key in SPLIT_KEYS},
                           "settings": mine[0]["settings"],
                           "rounds": [{key: r[key] for key in ("median_step_s", "steps_measured", "wall_s")}
                                      for r in mine]}
            modes[mode]["median_step_s"] = modes[mode]["time/step"]
        results["workloads"][workload] = {
            "modes": modes,
            "co_vs_sc": modes["sc"]["median_step_s"] / modes["co"]["median_step_s"],
            "da_vs_co": modes["co"]["median_step_s"] / modes["da"]["median_step_s"],
            "co_vs_sc_per_round": [sc["median_step_s"] / co["median_step_s"]
                                   for co, sc in zip(modes["co"]["rounds"], modes["sc"]["rounds"])],
        }
    results["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"{'workload':<14}{'mode':<5}{'step s':>8}{'device':>8}{'host':>8}{'network':>9}")
    for workload, entry in results["workloads"].items():
        for mode, s in entry["modes"].items():
            print(f"{workload:<14}{mode:<5}{s['time/step']:>8.3f}{s['time/device']:>8.3f}{s['time/host']:>8.3f}"
                  f"{s['time/network']:>9.3f}")
        print(f"{workload:<14}co_vs_sc={entry['co_vs_sc']:.2f} da_vs_co={entry['da_vs_co']:.2f} (co_vs_sc by round: "
              + ", ".join(f"{x:.2f}" for x in entry["co_vs_sc_per_round"]) + ")")
    host_heavy = results["workloads"].get("host_heavy")
    if host_heavy:
        print(f"co_vs_sc_host_heavy={host_heavy['co_vs_sc']:.2f}")


if __name__ == "__main__":
    main()
