"""RL algorithm pieces, chosen by name from `AlgoSpec`: advantage estimators (`ADVANTAGES`:
grpo, dr_grpo, rloo), policy losses (`POLICY_LOSSES`: grpo, the clipped surrogate with the k3 KL)
and loss aggregations (`LOSS_AGGREGATIONS`: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm)."""

from locojax.algo.advantages import ADVANTAGES, AdvantageFn, compute_advantages
from locojax.algo.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    TokenWeights,
    aggregate,
    clipped_surrogate,
    grpo_objective,
    k3_kl,
)

__all__ = [
    "ADVANTAGES", "AdvantageFn", "compute_advantages", "LOSS_AGGREGATIONS", "POLICY_LOSSES", "TokenWeights", "aggregate",
    "clipped_surrogate", "grpo_objective", "k3_kl",
]
