"""The newcomer's demo: SFT warm start, then CO GRPO on generated arithmetic, with a reward plot.

Two ordinary runs (`demo_specs`): an SFT run (`kind: sft`) that exports `<out>/sft/model`, and a GRPO
run whose `model.checkpoint` names it. `locojax demo` runs both in this process; the control plane
submits the same two specs over its REST API.

Why these settings (measured on the 2-core CPU; PITFALLS.md, "GRPO on a tiny model"):
* arith difficulty 0, bare equations `45+14=` -> `#### 59`: at most 7 prompt and 8 completion tokens,
  so a GRPO step of 32 prompts x 8 samples costs ~1.4 CPU-seconds, a fraction of a story problem's
  (level 1: ~60 prompt and ~17 completion tokens).
* SFT stops part-way (200 steps of 128 at lr 1e-3, constant): at seed 0 the model then answers ~0.28
  of held-out prompts right when sampling at temperature 1 and ~0.45 greedily. Most groups of 8 mix
  right and wrong answers, which is what GRPO learns from (a group with equal rewards has zero
  advantage). A model SFT'd to high accuracy leaves GRPO nothing to do; one SFT'd too little gives
  it no signal (at 150 SFT steps, 0.12 sampled accuracy, fewer than half the groups were mixed).
* GRPO lr 1e-4 after a 10-step warmup, no KL, temperature 1. Higher rates sharpen the policy onto its
  current answers faster and stall lower: from the same start, 2e-4..5e-4 gained +0.05..+0.16 in
  100-120 steps, and 1e-3 (with or without a 0.05 KL) lost almost all reward within 10 steps. At 1e-4
  the reward keeps rising for 200 steps, and greedy accuracy rises with it (real learning, not only
  sharpening: 0.375 -> 0.586 on held-out prompts after 100 steps).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from locojax import metrics as m
from locojax.contract import METRICS_FILE
from locojax.spec import RunSpec

DEMO_TASK = {"name": "arith", "difficulty": 0}
# The longest prompt is BOS + `99-99=` (7 tokens); the longest reference `#### 99` + EOS (8 tokens).
DEMO_ROLLOUT = {"prompts_per_step": 32, "group_size": 8, "max_prompt_tokens": 8, "max_new_tokens": 8,
                "temperature": 1.0}
SFT_STEPS = 200
SFT_BATCH = 128
SFT_LR = 1e-3
GRPO_STEPS = 200
GRPO_LR = 1e-4
GRPO_WARMUP = 10
# Held-out greedy accuracy and pass@4 before GRPO (step 0, the SFT model), every 50 steps and after the
# last: 128 prompts x (1 greedy + 3 samples) cost about as much as two GRPO rollouts.
DEMO_EVAL = {"every": 50, "prompts": 128, "k": 4}


def demo_specs(out: Path, grpo_steps: int = GRPO_STEPS, seed: int = 0,
               sft_steps: int = SFT_STEPS) -> tuple[RunSpec, RunSpec]:
    """(sft_spec, grpo_spec): the SFT run writes `<out>/sft`, the GRPO run starts from its model."""
    out = Path(out)
    sft = RunSpec.model_validate({
        "name": "demo-sft", "kind": "sft", "seed": seed, "model": {"preset": "small"}, "task": DEMO_TASK,
        "rollout": {**DEMO_ROLLOUT, "prompts_per_step": SFT_BATCH},  # the SFT batch size
        "optim": {"lr": SFT_LR, "warmup_steps": 10, "decay": "constant"},
        "steps": sft_steps, "output_dir": str(out / "sft"),
        "checkpoint": {"every": 100, "keep": 1},
    })
    from locojax.modes.sft import export_dir

    grpo = RunSpec.model_validate({
        "name": "demo-grpo", "kind": "grpo", "seed": seed,
        "model": {"preset": "small", "checkpoint": str(export_dir(sft))},
        "task": DEMO_TASK, "rollout": DEMO_ROLLOUT,
        "algo": {"name": "grpo", "kl_coef": 0.0, "loss_agg": "token_mean"},
        "optim": {"lr": GRPO_LR, "warmup_steps": GRPO_WARMUP, "decay": "constant"},
        "steps": grpo_steps, "output_dir": str(out / "grpo"),
        "checkpoint": {"every": 50, "keep": 1},
        "eval": DEMO_EVAL,
    })
    return sft, grpo


def plot_rewards(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("host") == m.ALL_HOSTS and m.REWARD_MEAN in r]  # not eval-only rows
    steps = [r["step"] for r in rows]
    rewards = [r[m.REWARD_MEAN] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, lw=1, alpha=0.5, label="reward/mean")
    if len(rewards) >= 10:
        smooth = np.convolve(rewards, np.ones(10) / 10, mode="valid")
        ax.plot(steps[9:], smooth, lw=2, label="10-step mean")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (exact answer)")
    ax.set_ylim(0, 1)
    ax.set_title("LoCoJAX demo: CO GRPO on arith, small preset")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reward_summary(rewards: Sequence[float], png: Path, metrics_path: Path | None = None) -> str:
    """First-10 vs last-10 mean reward of a GRPO run, and its curve plotted to `png` (from the run's
    metrics.jsonl when there is one, else from `rewards`, one value per step)."""
    png = Path(png)
    if metrics_path is not None and Path(metrics_path).is_file():
        records = m.read_jsonl(metrics_path)
    else:
        records = [{"host": m.ALL_HOSTS, "step": step, m.REWARD_MEAN: r} for step, r in enumerate(rewards)]
    if not rewards:
        return "no GRPO reward recorded"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_rewards(records, png)
    first, last = float(np.mean(rewards[:10])), float(np.mean(rewards[-10:]))
    return f"GRPO reward first 10 steps {first:.3f} -> last 10 steps {last:.3f} ({last - first:+.3f}); plot: {png}"


def eval_summary(steps: Sequence[int], accuracy: Sequence[float], pass_at_k: Sequence[float], k: int) -> str:
    """Held-out accuracy and pass@k of the first evaluation (before GRPO) and the last (after it)."""
    if not steps:
        return "no held-out evaluation recorded"
    return (f"held-out eval ({DEMO_EVAL['prompts']} prompts) before GRPO (step {steps[0]}): accuracy "
            f"{accuracy[0]:.3f}, pass@{k} {pass_at_k[0]:.3f} -> after (step {steps[-1]}): accuracy {accuracy[-1]:.3f} "
            f"({accuracy[-1] - accuracy[0]:+.3f}), pass@{k} {pass_at_k[-1]:.3f}")


def eval_series(records: Sequence[dict]) -> tuple[list[int], list[float], list[float]]:
    """(steps, eval/accuracy, eval/pass@k) of a run's aggregate records, in step order."""
    rows = sorted((r for r in records if r.get("host") == m.ALL_HOSTS and r.get(m.EVAL_ACCURACY) is not None),
                  key=lambda r: r["step"])
    return [r["step"] for r in rows], [r[m.EVAL_ACCURACY] for r in rows], [r[m.EVAL_PASS_AT_K] for r in rows]


def run_demo(out: Path, console: bool = True, sft_steps: int = SFT_STEPS, grpo_steps: int = GRPO_STEPS,
             seed: int = 0) -> str:
    from locojax.runner import run_mode

    out = Path(out)
    sft_spec, grpo_spec = demo_specs(out, grpo_steps, seed, sft_steps)
    for spec in (sft_spec, grpo_spec):  # a fresh demo: no metrics or checkpoints of an earlier one
        shutil.rmtree(spec.output_dir, ignore_errors=True)
    start = time.perf_counter()
    sft = run_mode(sft_spec, console=console)
    sft_s = time.perf_counter() - start
    grpo = run_mode(grpo_spec, console=console)
    total_s = time.perf_counter() - start
    records = m.read_jsonl(Path(grpo_spec.output_dir) / METRICS_FILE)
    rewards = [r[m.REWARD_MEAN] for r in records if r.get("host") == m.ALL_HOSTS and m.REWARD_MEAN in r]
    summary = reward_summary(rewards, out / "reward.png", Path(grpo_spec.output_dir) / METRICS_FILE)
    evaluated = eval_summary(*eval_series(records), grpo_spec.eval.k)
    return (f"sft loss {sft.final_metrics.get(m.LOSS_SFT, float('nan')):.3f} in {sft_s:.0f} s; {summary}; "
            f"{evaluated}; GRPO {(total_s - sft_s) / max(1, grpo.steps_done):.2f} s/step; total {total_s:.0f} s")
