"""Held-out evaluation: greedy accuracy and pass@k of a policy on one host's shard of held-out prompts.

Accuracy is the greedy (temperature 0) completion scored by the task's own correctness rewards
(`task.default_rewards`, not the spec's training rewards, which may add shaping): a prompt is
answered right when every one of them gives full credit. pass@k counts a prompt right when any of
k attempts is: the greedy completion and k-1 samples at `eval.temperature`, so pass@1 is the
accuracy and pass@k >= accuracy by definition. Sampling keys depend on (seed, row) only, with a
row's *global* index in the held-out list, so any host layout draws the same samples.

Hosts exchange counts, not ratios: `metrics.aggregate_hosts` sums `eval/correct` and
`eval/prompts` and divides, so H hosts report exactly what one host does on the same prompts.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from locojax import metrics as m
from locojax.policy import Policy, to_local
from locojax.rewards import score
from locojax.rollout import (
    SamplingConfig,
    decode_completions,
    encode_prompts,
    make_generate_fn,
    repeat_groups,
    rollout_mesh,
)
from locojax.spec import EvalSpec, RunSpec
from locojax.tasks import Example, Task

# Folded into the run's seed for evaluation samples: a stream apart from every training step's.
EVAL_KEY_TAG = 0xE7A1


@dataclasses.dataclass(frozen=True)
class EvalCounts:
    prompts: int
    correct: int  # greedy completion right
    pass_correct: int  # right in at least one of the k attempts

    def metrics(self, seconds: float | None = None) -> dict[str, float]:
        out = {m.EVAL_PROMPTS: float(self.prompts), m.EVAL_CORRECT: float(self.correct),
               m.EVAL_PASS_CORRECT: float(self.pass_correct),
               m.EVAL_ACCURACY: self.correct / self.prompts if self.prompts else float("nan"),
               m.EVAL_PASS_AT_K: self.pass_correct / self.prompts if self.prompts else float("nan")}
        if seconds is not None:
            out[m.EVAL_TIME] = seconds
        return out


class _Decoder:
    """One jitted generate function and the placement its params need."""

    def __init__(self, policy: Policy, sampling: SamplingConfig, prompt_len: int, batch: int,
                 devices: Sequence[jax.Device]):
        self.generate = make_generate_fn(policy.config, policy.graphdef, sampling, prompt_len, batch, tuple(devices))
        self.replicated = NamedSharding(rollout_mesh(batch, devices), PartitionSpec())


class Evaluator:
    """Evaluates policies on a fixed shard of held-out examples, compiled once for its shapes.

    `first_index`: the shard's position in the whole held-out list (its rows' global indices).
    """

    def __init__(self, spec: RunSpec, eval_spec: EvalSpec, policy: Policy, examples: Sequence[Example],
                 reward_names: Sequence[str], first_index: int, devices: Sequence[jax.Device]):
        self.examples, self.k, self.first_index = list(examples), eval_spec.k, first_index
        self.reward_names = tuple(reward_names)
        self.tokenizer = policy.tokenizer
        self.key = jax.random.fold_in(jax.random.key(spec.seed), EVAL_KEY_TAG)
        count, prompt_len = len(self.examples), spec.rollout.max_prompt_tokens
        if not count:
            return
        self.tokens, self.mask = encode_prompts([e.prompt for e in self.examples], policy.tokenizer, prompt_len)
        base = SamplingConfig.from_spec(spec.rollout, policy.tokenizer)
        self.greedy = _Decoder(policy, dataclasses.replace(base, temperature=0.0, top_p=1.0, top_k=0),
                               prompt_len, count, devices)
        self.sampled = (_Decoder(policy, dataclasses.replace(base, temperature=eval_spec.temperature), prompt_len,
                                 count * (self.k - 1), devices) if self.k > 1 else None)

    def _right(self, completions: list[str], examples: list[Example]) -> np.ndarray:
        _, per_fn = score(self.reward_names, completions, examples)
        return np.all([per_fn[name] >= 1.0 for name in self.reward_names], axis=0)  # [n] bool

    def __call__(self, params) -> EvalCounts:
        """Counts for `params` (globally replicated train params or a host-local copy)."""
        count = len(self.examples)
        if not count:
            return EvalCounts(0, 0, 0)
        greedy = self.greedy.generate(to_local(params, self.greedy.replicated), self.tokens, self.mask, self.key,
                                      self.first_index)
        right = self._right(decode_completions(greedy, self.tokenizer), self.examples)  # [n]
        passed = right.copy()
        if self.sampled is not None:
            samples = self.k - 1
            result = self.sampled.generate(to_local(params, self.sampled.replicated),
                                           repeat_groups(self.tokens, samples), repeat_groups(self.mask, samples),
                                           self.key, self.first_index * samples)
            repeated = [e for e in self.examples for _ in range(samples)]
            sampled_right = self._right(decode_completions(result, self.tokenizer), repeated).reshape(count, samples)
            passed |= sampled_right.any(axis=1)
        return EvalCounts(count, int(right.sum()), int(passed.sum()))

    def timed(self, params) -> dict[str, float]:
        start = time.perf_counter()
        counts = self(params)
        return counts.metrics(time.perf_counter() - start)


def evaluation_due(eval_spec: EvalSpec, step: int) -> bool:
    """Whether step `step` starts with an evaluation (the one after the last step is always run)."""
    return step % eval_spec.every == 0 if eval_spec.every else step == 0


def eval_rewards(eval_spec: EvalSpec, task: Task) -> tuple[str, ...]:
    """The rewards that decide correctness: the eval block's list if given, else the task's own."""
    return tuple(eval_spec.reward) if eval_spec.reward else task.default_rewards
