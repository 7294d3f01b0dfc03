"""Does LoRA GRPO learn? Its held-out accuracy gain next to full fine-tuning's, from the same start.

On the demo task (locojax.demo: arith difficulty 0, the `small` preset, CO on one host) this script runs
one SFT warm start, then two GRPO runs from its exported model with the same seed, steps, rollout and
evaluation: full fine-tuning at its learning rate (the demo's, 1e-4) and LoRA (rank 16, alpha 32, every
projection) at its own (1e-3, ten times higher, the usual rule for adapters; chosen before this ran, not
tuned on the held-out prompts). Each run evaluates greedy accuracy on the same held-out prompts before
its first step (the SFT model either way: fresh adapters add exactly zero) and after its last. The gain
is after - before; the headline is `ratio` = LoRA's gain / full fine-tuning's (issue 40's target: >= 0.8).

The machine is shared: the 1-minute load average is recorded at the start and end of every run, with
each run's wall time and GRPO seconds per step. Run it under the shared lock:

    flock /tmp/locojax-heavy.lock .venv/bin/python bench/lora_learning.py

Writes bench/results/lora_learning.json and prints a table. `--grpo-steps`, `--sft-steps`, `--lora-lr`,
`--full-lr`, `--eval-prompts` change the setting (the JSON records what was used).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "lora_learning.json"
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _timed_run(spec) -> dict:
    from locojax import metrics as m
    from locojax.contract import METRICS_FILE
    from locojax.demo import eval_series
    from locojax.runner import run_mode

    shutil.rmtree(spec.output_dir, ignore_errors=True)
    load_start, start = os.getloadavg()[0], time.perf_counter()
    result = run_mode(spec, console=False)
    wall = time.perf_counter() - start
    records = m.read_jsonl(Path(spec.output_dir) / METRICS_FILE)
    steps = [r for r in records if r.get("host") == m.ALL_HOSTS and m.TIME_STEP in r]
    out = {"status": result.status, "steps_done": result.steps_done, "wall_s": round(wall, 1),
           "load_avg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
           "s_per_step": round(sum(r[m.TIME_STEP] for r in steps[1:]) / max(1, len(steps) - 1), 3),
           "checkpoint_bytes": result.checkpoint_bytes}
    if spec.kind == "grpo":
        eval_steps, accuracy, pass_at_k = eval_series(records)
        rewards = [r[m.REWARD_MEAN] for r in steps if m.REWARD_MEAN in r]
        out.update(eval_steps=eval_steps, accuracy=accuracy, pass_at_k=pass_at_k,
                   accuracy_gain=round(accuracy[-1] - accuracy[0], 4),
                   reward_first10=round(sum(rewards[:10]) / len(rewards[:10]), 4),
                   reward_last10=round(sum(rewards[-10:]) / len(rewards[-10:]), 4))
    else:
        out["final_loss"] = result.final_metrics.get(m.LOSS_SFT)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/locojax-lora-learning"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--grpo-steps", type=int, default=100)
    parser.add_argument("--full-lr", type=float, default=1e-4)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--result", type=Path, default=RESULT,
                        help="where to write the JSON (another file for a run at other settings)")
    args = parser.parse_args()

    from locojax.commands import configure_jax

    configure_jax(1)
    from locojax.demo import demo_specs
    from locojax.spec import RunSpec

    sft, grpo = demo_specs(args.out, args.grpo_steps, args.seed, args.sft_steps)
    evaluation = {**grpo.eval.model_dump(), "every": args.grpo_steps, "prompts": args.eval_prompts}

    def grpo_spec(name: str, lr: float, lora: dict | None) -> RunSpec:
        body = grpo.model_dump(mode="json")
        body.update(name=name, output_dir=str(args.out / name), eval=evaluation,
                    optim={**body["optim"], "lr": lr}, checkpoint={"every": 0, "keep": 1})
        if lora is not None:
            body["model"] = {**body["model"], "lora": lora}
        return RunSpec.model_validate(body)

    lora = {"rank": args.rank, "alpha": args.alpha, "targets": TARGETS}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = {"sft": _timed_run(sft)}
    runs["full"] = _timed_run(grpo_spec("grpo-full", args.full_lr, None))
    runs["lora"] = _timed_run(grpo_spec("grpo-lora", args.lora_lr, lora))
    full_gain, lora_gain = runs["full"]["accuracy_gain"], runs["lora"]["accuracy_gain"]
    ratio = lora_gain / full_gain if full_gain > 0 else None
    result = {
        "commit": _commit(), "started_utc": started, "cores": len(os.sched_getaffinity(0)),
        "setting": {"task": "arith difficulty 0 (locojax.demo)", "preset": "small", "seed": args.seed,
                    "sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps,
                    "eval_prompts": args.eval_prompts, "lora": lora,
                    "rollout": grpo.rollout.model_dump(), "warmup_steps": grpo.optim.warmup_steps},
        "full_lr": args.full_lr, "lora_lr": args.lora_lr,
        "full_gain": full_gain, "lora_gain": lora_gain, "ratio": None if ratio is None else round(ratio, 3),
        "target_ratio": 0.8, "meets_target": ratio is not None and ratio >= 0.8,
        "runs": runs,
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'run':6} {'lr':>8} {'acc before':>10} {'acc after':>10} {'gain':>7} {'s/step':>7} {'ckpt bytes':>11} load")
    for name, lr in (("full", args.full_lr), ("lora", args.lora_lr)):
        r = runs[name]
        print(f"{name:6} {lr:8.0e} {r['accuracy'][0]:10.3f} {r['accuracy'][-1]:10.3f} {r['accuracy_gain']:+7.3f} "
              f"{r['s_per_step']:7.3f} {r['checkpoint_bytes'] or 0:11d} {r['load_avg_1m']}")
    print(f"ratio (LoRA gain / full gain) = {result['ratio']} (target >= 0.8) -> {args.result}")


if __name__ == "__main__":
    main()
