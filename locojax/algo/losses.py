"""Policy losses: the clipped surrogate with separate low/high clip, the k3 KL penalty, and the
loss aggregations.

Everything is per token first ([B, N]: B sequences, N completion slots), then reduced with
*token weights*: an aggregation maps the completion mask of the WHOLE batch to weights w [B, N]
and the loss is sum(w * per_token_loss). Writing every aggregation as a weighted sum with
normalisers taken over the whole batch makes it linear in the tokens, so gradient accumulation
over micro-batches (sum of per-micro-batch weighted sums) is exactly the full-batch gradient, and
a data-parallel batch sharded over hosts reduces with one all-reduce. A mean per micro-batch
would not be.

Aggregations (registered in `LOSS_AGGREGATIONS`, chosen by `AlgoSpec.loss_agg`):
  token_mean               sum over all completion tokens / number of completion tokens
  seq_mean_token_mean      per sequence: mean over its tokens; then mean over sequences
  seq_mean_token_sum_norm  per sequence: sum over its tokens / N (max_new_tokens); then mean over
                           sequences (Dr. GRPO: no length normalisation bias)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from locojax import metrics as m
from locojax.registry import Registry

# completion_mask [B, N] bool -> token weights [B, N] float32 summing to the aggregation's mean.
TokenWeights = Callable[[jax.Array], jax.Array]

LOSS_AGGREGATIONS: Registry[TokenWeights] = Registry("loss aggregation")


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean_weights(completion_mask: jax.Array) -> jax.Array:
    mask = completion_mask.astype(jnp.float32)
    return mask / jnp.maximum(mask.sum(), 1.0)


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean_weights(completion_mask: jax.Array) -> jax.Array:
    mask = completion_mask.astype(jnp.float32)
    lengths = jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)  # [B, 1]
    return mask / lengths / mask.shape[0]


@LOSS_AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm_weights(completion_mask: jax.Array) -> jax.Array:
    mask = completion_mask.astype(jnp.float32)
    batch, max_new_tokens = mask.shape
    return mask / (max_new_tokens * batch)


def aggregate(per_token: jax.Array, completion_mask: jax.Array, name: str) -> jax.Array:
    """Reduce per-token values [B, N] to a scalar with the aggregation registered as `name`."""
    weights = LOSS_AGGREGATIONS.get(name)(completion_mask)
    return jnp.sum(jnp.where(completion_mask, per_token, 0.0) * weights)


def clipped_surrogate(
    logprobs: jax.Array,  # [B, N] under the policy being trained
    old_logprobs: jax.Array,  # [B, N] under the policy that sampled (from rollout)
    advantages: jax.Array,  # [B]
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token PPO/GRPO loss -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A), r = exp(logp - old_logp).

    A larger `clip_eps_high` (DAPO clip-higher) lets low-probability tokens with positive advantage
    grow further before their gradient is cut, which counters entropy collapse. The same ratio is
    the importance correction for DA's one-step-stale rollouts, so `old_logprobs` is whatever policy
    sampled, not necessarily the current one.

    Returns (loss [B, N], clipped [B, N] bool: the clip zeroed this token's gradient, ratio [B, N]).
    """
    ratio = jnp.exp(logprobs - old_logprobs)
    adv = advantages[:, None].astype(jnp.float32)  # [B, 1]
    unclipped = ratio * adv
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = -jnp.minimum(unclipped, clipped_ratio * adv)
    clipped = ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps_low))
    return loss, clipped, ratio


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """Per-token KL(pi || pi_ref) estimate k3 = exp(d) - d - 1 with d = ref_logp - logp (Schulman).

    Unbiased for samples from pi, always >= 0, and zero exactly where the policies agree. `d` is
    clipped at +-20 so one wild token cannot overflow exp."""
    delta = jnp.clip(ref_logprobs - logprobs, -20.0, 20.0)
    return jnp.exp(delta) - delta - 1.0


# Policy losses by name (`AlgoSpec.loss`), each with grpo_objective's signature: (logprobs,
# old_logprobs, advantages, completion_mask, loss_weights, mean_weights, *, clip_eps_low,
# clip_eps_high, kl_coef, ref_logprobs, entropy) -> (loss, metrics as weighted sums).
POLICY_LOSSES: Registry[Callable[..., tuple[jax.Array, dict[str, jax.Array]]]] = Registry("policy loss")


@POLICY_LOSSES.register("grpo")
def grpo_objective(
    logprobs: jax.Array,  # [B, N]
    old_logprobs: jax.Array,  # [B, N]
    advantages: jax.Array,  # [B]
    completion_mask: jax.Array,  # [B, N] bool
    loss_weights: jax.Array,  # [B, N] from the aggregation over the whole batch
    mean_weights: jax.Array,  # [B, N] token_mean weights over the whole batch (for metrics)
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    kl_coef: float = 0.0,
    ref_logprobs: jax.Array | None = None,  # [B, N]; required when kl_coef > 0
    entropy: jax.Array | None = None,  # [B, N] per-token policy entropy, reported only
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of one (micro-)batch as a weighted sum, plus metrics as weighted sums.

    Because weights carry whole-batch normalisers, both the loss and every metric of the full
    batch are the plain sums of their values over micro-batches.
    Metrics: `loss/policy` and `loss/kl` under the chosen aggregation (kl before its coefficient),
    `policy/clip_frac` and `policy/entropy` as token means.
    """
    pg, clipped, _ = clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps_low, clip_eps_high)
    pg = jnp.where(completion_mask, pg, 0.0)
    policy_loss = jnp.sum(loss_weights * pg)
    metrics = {
        m.LOSS_POLICY: policy_loss,
        m.POLICY_CLIP_FRAC: jnp.sum(mean_weights * clipped.astype(jnp.float32)),
    }
    total = policy_loss
    if kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probs (batch['ref_logprobs'])")
        kl = jnp.sum(loss_weights * jnp.where(completion_mask, k3_kl(logprobs, ref_logprobs), 0.0))
        total = total + kl_coef * kl
        metrics[m.LOSS_KL] = kl
    if entropy is not None:
        metrics[m.POLICY_ENTROPY] = jnp.sum(mean_weights * jnp.where(completion_mask, entropy, 0.0))
    metrics[m.LOSS_TOTAL] = total
    return total, metrics
