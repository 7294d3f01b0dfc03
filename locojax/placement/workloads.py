"""Workload profiles for the placement cost model, registered by name in `WORKLOADS`.

A workload is what one GRPO step asks of the machine: how many prompts, how many samples per prompt,
how long prompts and generations are, and what one reward costs on a host CPU. Lengths are token
counts; a generation length is summarised by its cap (`gen_len`, what decode runs to: with dozens of
samples per batch at least one reaches it, and JAX's static shapes pad training to it) and its mean
(`gen_len_mean`: when samples finish, so what ragged attention reads and how much scoring can overlap
the decode still running). Sources are named next to each profile.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from locojax.registry import Registry

# Reward host cost per sample, measured on the 2-core development machine (the reference CPU of
# `HardwareProfile.reward_cpu_scale`): a `#### N` regex parse is ~3 us; math-verify's parse + verify
# is ~1.2 ms for a short `\boxed{}` answer and ~1.7 ms for a ~2,900-character CoT. Detokenizing a
# completion adds roughly 0.1 us per token (Rust `tokenizers`). Assumed per-sample totals below.
REFERENCE_REGEX_PARSE_S = 3.3e-6  # the `#### N` parse alone; `locojax probe` times it to scale CPUs
REGEX_REWARD_S = 50e-6  # detokenize ~300 tokens + `#### N` parse + compare
MATH_VERIFY_REWARD_S = 2e-3  # detokenize ~1000 tokens + math-verify on a long CoT
EQUATION_REWARD_S = 100e-6  # countdown: parse `<answer>` and evaluate a small arithmetic expression


@dataclasses.dataclass(frozen=True)
class WorkloadProfile:
    name: str
    description: str
    prompts_per_step: int
    group_size: int  # samples per prompt (GRPO group)
    prompt_len: int  # prompt tokens, padded (rollout.max_prompt_tokens)
    gen_len: int  # cap on generated tokens (rollout.max_new_tokens)
    gen_len_mean: int  # mean generated tokens
    reward_s_per_sample: float  # host CPU seconds on the reference CPU: detokenize, parse, verify
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for field in ("prompts_per_step", "group_size", "prompt_len", "gen_len", "gen_len_mean"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.gen_len_mean > self.gen_len:
            raise ValueError(f"gen_len_mean ({self.gen_len_mean}) must not exceed gen_len ({self.gen_len})")
        if self.reward_s_per_sample < 0:
            raise ValueError(f"reward_s_per_sample must not be negative, got {self.reward_s_per_sample}")

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def seq_len(self) -> int:
        """Padded sequence length of a training example."""
        return self.prompt_len + self.gen_len

    def replace(self, **changes: Any) -> "WorkloadProfile":
        """A copy with fields changed; `gen_len_mean` shrinks with a smaller `gen_len` cap."""
        if "gen_len" in changes and "gen_len_mean" not in changes:
            changes["gen_len_mean"] = min(self.gen_len_mean, changes["gen_len"])
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["sources"] = dict(self.sources)
        return data


WORKLOADS: Registry[WorkloadProfile] = Registry("workload")


def _add(profile: WorkloadProfile) -> WorkloadProfile:
    return WORKLOADS.register(profile.name)(profile)


_add(WorkloadProfile(
    name="gsm8k", description="GSM8K grade-school math, `#### N` answers (decode-heavy at these lengths)",
    prompts_per_step=16, group_size=8, prompt_len=128, gen_len=512, gen_len_mean=250,
    reward_s_per_sample=REGEX_REWARD_S,
    sources={"lengths": "FACTS.md: question ~60 tokens (+ chat template), answer ~70 (p90 ~120); a CoT "
                        "model writes more: cap 512, mean 250 assumed (verl Qwen3-1.7B GSM8K allows 1024)",
             "batch": "assumption: 16 prompts x 8 samples, a small-model GRPO batch (MaxText v6e-8 example: "
                      "8 x 4, FACTS.md)",
             "reward": "regex `#### N` parse, measured ~3 us, plus detokenize"},
))
_add(WorkloadProfile(
    name="numina-cot", description="NuminaMath-CoT, long chain-of-thought, `\\boxed{}` answers",
    prompts_per_step=24, group_size=8, prompt_len=256, gen_len=6144, gen_len_mean=900,
    reward_s_per_sample=MATH_VERIFY_REWARD_S,
    sources={"lengths": "FACTS.md: problem+solution ~350-420 tokens; long CoT generations: a long tail "
                        "assumed (cap 6144, mean 900)",
             "batch": "assumption: 24 prompts x 8 samples",
             "reward": "math-verify on `\\boxed{}`, measured ~1.2 ms for short answers, 2 ms assumed"},
))
_add(WorkloadProfile(
    name="math", description="MATH / MATH-500, `\\boxed{}` answers",
    prompts_per_step=32, group_size=8, prompt_len=256, gen_len=3072, gen_len_mean=500,
    reward_s_per_sample=MATH_VERIFY_REWARD_S,
    sources={"lengths": "FACTS.md: solution mean ~530 characters (~150 tokens); CoT generations assumed "
                        "(cap 3072, mean 500)",
             "batch": "assumption: 32 prompts x 8 samples",
             "reward": "math-verify on `\\boxed{}` (see numina-cot)"},
))
_add(WorkloadProfile(
    name="countdown", description="Countdown (TinyZero), equation in <answer></answer>",
    prompts_per_step=32, group_size=8, prompt_len=256, gen_len=1024, gen_len_mean=400,
    reward_s_per_sample=EQUATION_REWARD_S,
    sources={"lengths": "FACTS.md (TinyZero): prompt <= 256, response <= 1024",
             "batch": "assumption: 32 prompts x 8 samples"},
))
_add(WorkloadProfile(
    name="arith", description="generated 2-digit addition, the local demo and benchmark task",
    prompts_per_step=32, group_size=8, prompt_len=16, gen_len=6, gen_len_mean=4,
    reward_s_per_sample=5e-6,
    sources={"lengths": "PITFALLS.md: 32 prompts x 8 samples, max 4-6 new tokens; prompts are a few bytes",
             "reward": "exact-match compare, a few microseconds"},
))


def get_workload(name: str) -> WorkloadProfile:
    try:
        return WORKLOADS.get(name)
    except KeyError as exc:
        raise ValueError(f"workload: {exc.args[0]}") from None
