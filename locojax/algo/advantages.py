"""Advantage estimators: per-sample rewards of whole groups in, one advantage per sample out.

Every estimator sees rewards laid out group by group: rows [g*G, (g+1)*G) are the G samples of
prompt g, so a host that owns whole groups computes its advantages with no cross-host traffic
(DESIGN §5 step 4). Estimators are registered by name in `ADVANTAGES` and chosen by
`AlgoSpec.name`.

Signature of every estimator: `fn(rewards [B], group_size, eps) -> advantages [B]` (float32),
B a multiple of `group_size`. They are host work (every group is local) and use numpy: on a TPU,
`jax.numpy` on host arrays dispatches every small op to the chip and waits for it (2.6 ms of a 52 ms
step at bench/grpo_step.py's size; .tpu parts in bench/results).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from locojax.registry import Registry


class AdvantageFn(Protocol):
    def __call__(self, rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray: ...


ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def _grouped(rewards: np.ndarray, group_size: int) -> np.ndarray:
    rewards = np.asarray(rewards, np.float32)
    if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length that is a multiple of group_size={group_size}, "
            f"got shape {rewards.shape}"
        )
    return rewards.reshape(-1, group_size)  # [num_groups, G]


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """(r - group mean) / (group std + eps), std with ddof=0 (DeepSeekMath GRPO).

    A group whose rewards are all equal gets zero advantage (no signal), not a division blow-up.
    """
    grouped = _grouped(rewards, group_size)
    mean = grouped.mean(axis=1, keepdims=True)
    std = grouped.std(axis=1, keepdims=True)
    return ((grouped - mean) / (std + np.float32(eps))).reshape(-1)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """r - group mean. Dr. GRPO drops the std division, which over-weights groups whose rewards
    barely differ (too easy or too hard prompts). `eps` is unused; kept for a uniform signature."""
    del eps
    grouped = _grouped(rewards, group_size)
    return (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """r_i - mean of the other G-1 rewards of its group (REINFORCE leave-one-out baseline), which
    equals G/(G-1) * (r_i - group mean). A baseline that excludes the sample itself keeps the
    gradient estimate unbiased. Groups of one sample have no baseline and get zero advantage."""
    del eps
    grouped = _grouped(rewards, group_size)
    if group_size == 1:
        return np.zeros(grouped.shape[0], np.float32)
    total = grouped.sum(axis=1, keepdims=True)
    baseline = (total - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1)


def compute_advantages(name: str, rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """The estimator registered as `name` (an `AlgoSpec.name`) applied to grouped rewards [B]."""
    return ADVANTAGES.get(name)(rewards, group_size, eps)
