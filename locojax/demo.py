"""The newcomer's demo: SFT warm start, then CO GRPO on generated arithmetic, with a reward plot.

Sizes follow what was seen to learn on a 2-core CPU (PITFALLS.md, "GRPO on a tiny model"): the
`small` preset, SFT with a constant learning rate, then GRPO with no KL at a lower rate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from locojax import metrics as m
from locojax.spec import RunSpec

DEMO_TASK = {"name": "arith", "difficulty": 1}
# Prompts of arith difficulty 1 are at most 58 bytes with BOS; references at most 17 with EOS.
DEMO_ROLLOUT = {"prompts_per_step": 16, "group_size": 8, "max_prompt_tokens": 60, "max_new_tokens": 18,
                "temperature": 1.0}


def demo_specs(out: Path, grpo_steps: int = 120, seed: int = 0) -> tuple[RunSpec, RunSpec]:
    sft = RunSpec.model_validate({"name": "demo-sft", "seed": seed, "model": {"preset": "small"},
                                  "task": DEMO_TASK, "rollout": DEMO_ROLLOUT, "steps": 1})
    grpo = RunSpec.model_validate({
        "name": "demo-grpo", "seed": seed,
        "model": {"preset": "small", "checkpoint": str(out / "sft")},
        "task": DEMO_TASK, "rollout": DEMO_ROLLOUT,
        "algo": {"name": "grpo", "kl_coef": 0.0, "loss_agg": "token_mean"},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "decay": "constant"},
        "steps": grpo_steps, "output_dir": str(out / "grpo"),
        "checkpoint": {"every": 50, "keep": 1},
    })
    return sft, grpo


def plot_rewards(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("host") == m.ALL_HOSTS]
    steps = [r["step"] for r in rows]
    rewards = [r[m.REWARD_MEAN] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, lw=1, alpha=0.5, label="reward/mean")
    if len(rewards) >= 10:
        smooth = np.convolve(rewards, np.ones(10) / 10, mode="valid")
        ax.plot(steps[9:], smooth, lw=2, label="10-step mean")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (exact answer)")
    ax.set_title("LoCoJAX demo: CO GRPO on arith, small preset")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(out: Path, console: bool = True, sft_steps: int = 150, grpo_steps: int = 80, seed: int = 0,
             sft_batch: int = 64) -> str:
    from locojax.modes.co import run_co
    from locojax.sft import run_sft

    out = Path(out)
    sft_spec, grpo_spec = demo_specs(out, grpo_steps, seed)
    logger = m.MetricsLogger([m.ConsoleSink(sft_steps, description="sft")] if console else [])
    try:
        sft_last = run_sft(sft_spec, out / "sft", sft_steps, batch_size=sft_batch, lr=1e-3, logger=logger)
    finally:
        logger.close()
    metrics_path = out / "grpo" / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    run_co(grpo_spec, console=console)
    records = m.read_jsonl(metrics_path)
    rewards = [r[m.REWARD_MEAN] for r in records if r.get("host") == m.ALL_HOSTS]
    plot_rewards(records, out / "reward.png")
    first, last = float(np.mean(rewards[:10])), float(np.mean(rewards[-10:]))
    return (f"sft loss {sft_last.get(m.LOSS_SFT, float('nan')):.3f}; GRPO reward first 10 steps {first:.3f} -> "
            f"last 10 steps {last:.3f} ({last - first:+.3f}); plot: {out / 'reward.png'}")
