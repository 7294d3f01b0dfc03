"""Supervised warm start: teacher-forced training on a task's reference answers.

RL from a random model sees zero reward (PITFALLS.md), so a GRPO run starts from the checkpoint this
writes: a Hugging Face directory (config.json + model.safetensors) that `model.checkpoint` can name.
The learning rate is held constant to the end: a prototype that ended SFT on a cosine-decayed rate
left a fragile model that GRPO made worse (PITFALLS.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from locojax import metrics as m
from locojax.modes.common import load_policy
from locojax.rollout import encode_prompts
from locojax.spec import OptimSpec, RunSpec
from locojax.tasks import global_batch, make_task
from locojax.tokenizer import Tokenizer
from locojax.train import init_train_state, make_optimizer, make_sft_step


def reference_batch(examples, tokenizer: Tokenizer, prompt_len: int, completion_len: int) -> dict[str, np.ndarray]:
    """Prompts left-padded to `prompt_len`; reference + EOS right-padded to `completion_len`."""
    prompt_tokens, prompt_mask = encode_prompts([e.prompt for e in examples], tokenizer, prompt_len)
    completion = np.full((len(examples), completion_len), tokenizer.pad_id, np.int32)
    completion_mask = np.zeros((len(examples), completion_len), bool)
    for row, example in enumerate(examples):
        ids = (tokenizer.encode(example.reference) + [tokenizer.eos_id])[:completion_len]
        completion[row, :len(ids)] = ids
        completion_mask[row, :len(ids)] = True
    return {"tokens": np.concatenate([prompt_tokens, completion], axis=1), "prompt_mask": prompt_mask,
            "completion_mask": completion_mask}


def run_sft(spec: RunSpec, out_dir: str | Path, steps: int, batch_size: int, lr: float,
            logger: m.MetricsLogger | None = None) -> dict[str, float]:
    """Train `steps` SFT steps on one process and export the model to `out_dir`; returns last metrics."""
    from locojax.model.hf import save_hf_checkpoint

    policy = load_policy(spec)
    task = make_task(spec.task)
    optim = OptimSpec(lr=lr, warmup_steps=min(10, steps // 10), decay="constant", grad_clip=spec.optim.grad_clip)
    optimizer = make_optimizer(optim, steps)
    state = init_train_state(policy.params, optimizer, seed=spec.seed)
    step_fn = make_sft_step(policy.graphdef, optimizer, micro_batch_size=spec.algo.micro_batch_size)
    last: dict[str, float] = {}
    for step in range(steps):
        start = time.perf_counter()
        # A different data stream from GRPO's (seed offset), so RL prompts are not all memorised.
        examples = global_batch(task, spec.seed + 7919, step, batch_size)
        batch = reference_batch(examples, policy.tokenizer, spec.rollout.max_prompt_tokens,
                                spec.rollout.max_new_tokens)
        state, metrics = step_fn(state, batch)
        last = {k: float(v) for k, v in jax.device_get(metrics).items()}
        last[m.TIME_STEP] = time.perf_counter() - start
        if logger is not None:
            logger.log(step, last)
    model = nnx.merge(policy.graphdef, state.params)
    save_hf_checkpoint(model, out_dir)
    return last
