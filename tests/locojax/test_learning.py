"""Learning, not just running: from the same SFT'd start, 20 GRPO steps in DA mode improve the arith
reward like 20 steps in CO mode do (issue 5).

Both runs start from one session-scoped SFT warm start of the `tiny` model on bare `45+14=` equations
(arith difficulty 0), stopped part-way so samples mix right and wrong answers. The improvement is
measured without sampling noise: the expected exact-answer reward of a policy on a fixed set of
held-out prompts is (to within the rare other spellings of a right answer, e.g. `####59`) the
probability it gives the reference completion `#### 59<eos>`, which a teacher-forced forward pass
computes exactly. What remains random is the runs themselves (DA samples batch t+1 with the weights
one step behind), which the margins below allow for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from locojax import metrics as m
from locojax.checkpoint import load_params
from locojax.modes.common import load_policy
from locojax.modes.sft import reference_batch
from locojax.spec import parse_spec
from locojax.tasks import global_batch, make_task
from locojax.train import make_logprobs_fn
from tests.locojax.test_co import locojax, write_spec

TASK = {"name": "arith", "difficulty": 0}
SLOTS = {"max_prompt_tokens": 8, "max_new_tokens": 8}
GRPO_STEPS = 20
EVAL_PROMPTS = 512
EVAL_SEED = 12345  # a stream neither the SFT (seed + 7919) nor the GRPO runs (seed 0) draw from
MIN_GAIN = 0.04  # of expected reward over the 20 steps; see the test


@pytest.fixture(scope="session")
def sft_start(tmp_path_factory) -> Path:
    """A tiny policy SFT'd to ~0.25 sampled accuracy (600 steps of 64 at lr 3e-3, measured), exported."""
    root = tmp_path_factory.mktemp("sft-start")
    spec = {"name": "sft-tiny", "kind": "sft", "seed": 0, "model": {"preset": "tiny"}, "task": TASK,
            "rollout": {"prompts_per_step": 64, **SLOTS}, "optim": {"lr": 3e-3, "warmup_steps": 10},
            "steps": 600, "checkpoint": {"every": 0, "keep": 1}, "output_dir": str(root / "sft")}
    done = locojax("train", str(write_spec(root, spec)), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "sft" / "model"


def grpo_spec(tmp_path: Path, name: str, start: Path, **placement) -> dict:
    return {"name": name, "seed": 0, "model": {"preset": "tiny", "checkpoint": str(start)}, "task": TASK,
            # 128 prompts a step: with 32 the gain of 20 steps was +0.03..+0.04 and lr 1e-3 could lose
            # reward; with 128 it was +0.076..+0.084 for lr 3e-4..1e-3 and two seeds (CO, measured).
            "rollout": {"prompts_per_step": 128, "group_size": 8, "temperature": 1.0, **SLOTS},
            "optim": {"lr": 5e-4, "warmup_steps": 0}, "steps": GRPO_STEPS,
            "placement": {"mode": "co", "hosts": 1, "devices_per_host": 1, **placement},
            "checkpoint": {"every": GRPO_STEPS, "keep": 1}, "output_dir": str(tmp_path / name)}


def expected_reward(spec_dict: dict, params=None) -> float:
    """Mean probability of the reference completion over the held-out prompts (see the docstring)."""
    spec = parse_spec(spec_dict)
    policy = load_policy(spec)
    examples = global_batch(make_task(spec.task), EVAL_SEED, 0, EVAL_PROMPTS)
    batch = reference_batch(examples, policy.tokenizer, SLOTS["max_prompt_tokens"], SLOTS["max_new_tokens"])
    logprobs = make_logprobs_fn(policy.graphdef)(policy.params if params is None else params, batch["tokens"],
                                                 batch["prompt_mask"], batch["completion_mask"])
    return float(np.mean(np.exp(np.asarray(logprobs).sum(axis=1))))


def trained_params(spec_dict: dict, run_dir: Path):
    template = load_policy(parse_spec(spec_dict)).params
    return load_params(run_dir / "checkpoints", template, GRPO_STEPS)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_da_improves_the_reward_like_co_from_the_same_sft_start(tmp_path, sft_start):
    co = grpo_spec(tmp_path, "co", sft_start)
    da = grpo_spec(tmp_path, "da", sft_start, mode="da", hosts=2, rollout_fraction=0.5)
    for spec in (co, da):
        done = locojax("train", str(write_spec(tmp_path, spec)), "--quiet")
        assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in m.read_jsonl(tmp_path / "da" / "metrics.jsonl") if r["host"] == m.ALL_HOSTS]
    assert len(rows) == GRPO_STEPS and max(r[m.DA_STALENESS] for r in rows) == 1  # really one step stale

    start = expected_reward(co)
    gain_co = expected_reward(co, trained_params(co, tmp_path / "co")) - start
    gain_da = expected_reward(da, trained_params(da, tmp_path / "da")) - start
    print(f"expected reward: start {start:.3f}, CO {gain_co:+.3f}, DA {gain_da:+.3f}")
    # Partly right, so the runs have room to gain (they gain ~+0.09). The SFT start's expected reward is
    # 0.445 at XLA's default LLVM level and 0.501 at the level 0 the tests compile at (tests/conftest.py;
    # two SFT runs alike to the bit, one suite run 0.505): a bound of 0.5 failed on that, 0.6 does not.
    assert 0.1 < start < 0.6, f"the SFT start should be partly right, got {start:.3f}"
    # Both must gain at least half the ~+0.08 that CO gains in this setting (spread over lr and seed
    # was +-0.005), so a mode that does not learn, or unlearns, fails; and DA, one step stale, must
    # get at least half of CO's gain: "like CO does".
    assert gain_co > MIN_GAIN, f"CO did not learn: start {start:.3f}, gain {gain_co:+.3f}"
    assert gain_da > MIN_GAIN, f"DA did not learn: start {start:.3f}, gain {gain_da:+.3f}"
    assert gain_da > 0.5 * gain_co, f"DA learned much less than CO: {gain_da:+.3f} vs {gain_co:+.3f}"
