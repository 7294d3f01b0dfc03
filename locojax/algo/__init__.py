"""RL algorithm pieces, chosen by name from `AlgoSpec`: advantage estimators (`ADVANTAGES`:
grpo, dr_grpo, rloo) and loss aggregations (`LOSS_AGGREGATIONS`: token_mean,
seq_mean_token_mean, seq_mean_token_sum_norm), plus the clipped policy loss and the k3 KL."""

from locojax.algo.advantages import ADVANTAGES, AdvantageFn, compute_advantages
from locojax.algo.losses import (
    LOSS_AGGREGATIONS,
    TokenWeights,
    aggregate,
    clipped_surrogate,
    grpo_objective,
    k3_kl,
)

__all__ = [
    "ADVANTAGES", "AdvantageFn", "compute_advantages", "LOSS_AGGREGATIONS", "TokenWeights", "aggregate",
    "clipped_surrogate", "grpo_objective", "k3_kl",
]
