"""Advantage estimators, the clipped surrogate, the k3 KL and the loss aggregations on hand-computed cases."""

import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from locojax import metrics as m
from locojax.algo import (
    ADVANTAGES, LOSS_AGGREGATIONS, aggregate, clipped_surrogate, compute_advantages, grpo_objective, k3_kl,
)
from locojax.spec import AlgoSpec

# float32 exp and log: exact to rounding on CPU; a TPU's are approximations good to ~1e-4 relative
# (measured 6e-5 at ratio 1.5), still far finer than the cases' differences (clipped or not).
TRANSCENDENTAL_RTOL = 1e-5 if jax.default_backend() == "cpu" else 2e-4

# Two groups of G=4: the first has signal, the second all-equal rewards.
REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], np.float32)


def test_registries_cover_the_spec():
    assert ADVANTAGES.names() == sorted(typing.get_args(AlgoSpec.model_fields["name"].annotation))
    assert LOSS_AGGREGATIONS.names() == sorted(typing.get_args(AlgoSpec.model_fields["loss_agg"].annotation))
    with pytest.raises(KeyError, match="known: dr_grpo, grpo, rloo"):
        ADVANTAGES.get("ppo")


def test_grpo_normalises_by_group_mean_and_std():
    adv = np.asarray(compute_advantages("grpo", REWARDS, 4))
    # group 1: mean 0.5, std (ddof 0) 0.5 -> +-1; group 2: no spread -> 0, not a division by zero.
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)
    # G=3 group [3, 0, 0]: mean 1, std sqrt(2).
    adv3 = np.asarray(compute_advantages("grpo", np.array([3.0, 0.0, 0.0]), 3))
    np.testing.assert_allclose(adv3, np.array([2.0, -1.0, -1.0]) / math.sqrt(2.0), rtol=1e-5)


def test_dr_grpo_subtracts_only_the_group_mean():
    adv = np.asarray(compute_advantages("dr_grpo", REWARDS, 4))
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=1e-6)


def test_rloo_uses_the_leave_one_out_baseline():
    adv = np.asarray(compute_advantages("rloo", REWARDS, 4))
    # r=1: others (0, 0, 1) average 1/3; r=0: others (1, 0, 1) average 2/3.
    np.testing.assert_allclose(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(compute_advantages("rloo", np.array([3.0, 0.0, 0.0]), 3), [3.0, -1.5, -1.5], atol=1e-6)
    np.testing.assert_array_equal(compute_advantages("rloo", np.array([1.0, 0.0]), 1), [0.0, 0.0])


def test_advantages_reject_partial_groups():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        compute_advantages("grpo", np.zeros(6), 4)


def test_clipped_surrogate_at_known_ratios():
    # (advantage, ratio) -> expected per-token loss, clipped?  eps_low 0.2, eps_high 0.28.
    cases = [
        (+1.0, 1.50, -1.28, True),   # above 1+eps_high with A>0: capped
        (+1.0, 1.20, -1.20, False),  # inside clip-higher (would be clipped at a symmetric 0.2)
        (+1.0, 0.50, -0.50, False),  # A>0 with a low ratio: never clipped (min picks r*A)
        (-1.0, 0.50, +0.80, True),   # below 1-eps_low with A<0: capped
        (-1.0, 0.85, +0.85, False),  # inside
        (-1.0, 1.50, +1.50, False),  # A<0 with a high ratio: never clipped
    ]
    adv = jnp.array([c[0] for c in cases])
    ratio = jnp.array([c[1] for c in cases])
    old = jnp.full((len(cases), 1), -1.0)
    logp = old + jnp.log(ratio)[:, None]
    surrogate = jax.jit(lambda lp: clipped_surrogate(lp, old, adv, 0.2, 0.28))  # one compile, not an op each
    loss, clipped, got_ratio = surrogate(logp)
    np.testing.assert_allclose(loss[:, 0], [c[2] for c in cases], rtol=TRANSCENDENTAL_RTOL)
    np.testing.assert_array_equal(clipped[:, 0], [c[3] for c in cases])
    np.testing.assert_allclose(got_ratio[:, 0], ratio, rtol=TRANSCENDENTAL_RTOL)
    # Clipped tokens pass no gradient; the others get d(-r*A)/dlogp = -r*A.
    grad = jax.jit(jax.grad(lambda lp: surrogate(lp)[0].sum()))(logp)[:, 0]
    expected = np.where([c[3] for c in cases], 0.0, -np.asarray(ratio) * np.asarray(adv))
    np.testing.assert_allclose(grad, expected, rtol=TRANSCENDENTAL_RTOL, atol=1e-7)


def test_k3_kl_is_nonnegative_zero_at_equal_policies_and_unbiased():
    rng = np.random.default_rng(0)
    logp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(64, 10)) * 2.0, jnp.float32))
    ref = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(64, 10)) * 2.0, jnp.float32))
    assert float(k3_kl(logp, ref).min()) >= 0.0
    np.testing.assert_array_equal(k3_kl(logp, logp), 0.0)
    # Its expectation under pi is exactly KL(pi || ref): sum_x p (ref/p - log(ref/p) - 1) = KL.
    p = jnp.exp(logp)
    expected = jnp.sum(p * (logp - ref), axis=-1)
    np.testing.assert_allclose(jnp.sum(p * k3_kl(logp, ref), axis=-1), expected, rtol=1e-4, atol=1e-6)


# Two sequences, N=4; the second ends after 2 tokens and holds garbage in its pads.
PER_TOKEN = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 100.0, 100.0]])
MASK = jnp.array([[True, True, True, True], [True, True, False, False]])


@pytest.mark.parametrize("name, expected", [
    ("token_mean", 21 / 6),                        # (1+2+3+4+5+6) / 6 tokens
    ("seq_mean_token_mean", (10 / 4 + 11 / 2) / 2),  # per-sequence means, then their mean
    ("seq_mean_token_sum_norm", (10 / 4 + 11 / 4) / 2),  # per-sequence sums / N=4, then mean
])
def test_aggregations_by_hand(name, expected):
    assert float(aggregate(PER_TOKEN, MASK, name)) == pytest.approx(expected, rel=1e-6)
    weights = LOSS_AGGREGATIONS.get(name)(MASK)
    assert float(jnp.abs(jnp.where(MASK, 0.0, weights)).sum()) == 0.0  # pads weigh nothing


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregations_split_exactly_over_micro_batches(name):
    """Whole-batch weights make a micro-batched sum equal to the full-batch aggregate."""
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    mask = jnp.asarray(rng.random((8, 5)) < 0.7).at[:, 0].set(True)
    weights = LOSS_AGGREGATIONS.get(name)(mask)
    parts = sum(float(jnp.sum((weights * values)[i::4])) for i in range(4))
    assert parts == pytest.approx(float(aggregate(values, mask, name)), rel=1e-5)


def test_grpo_objective_combines_policy_and_kl():
    rng = np.random.default_rng(1)
    logp = jnp.asarray(-rng.random((2, 4)), jnp.float32)
    old = logp + 0.3 * jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
    ref = logp - 0.5
    adv = jnp.array([1.0, -0.5])
    weights = LOSS_AGGREGATIONS.get("seq_mean_token_mean")(MASK)
    means = LOSS_AGGREGATIONS.get("token_mean")(MASK)
    total, metrics = grpo_objective(logp, old, adv, MASK, weights, means, clip_eps_low=0.2, clip_eps_high=0.28,
                                    kl_coef=0.1, ref_logprobs=ref, entropy=jnp.ones((2, 4)))
    pg, clipped, _ = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    kl = aggregate(k3_kl(logp, ref), MASK, "seq_mean_token_mean")
    assert float(kl) > 0.0
    assert float(metrics[m.LOSS_POLICY]) == pytest.approx(float(aggregate(pg, MASK, "seq_mean_token_mean")), rel=1e-6)
    assert float(metrics[m.LOSS_KL]) == pytest.approx(float(kl), rel=1e-6)
    assert float(total) == pytest.approx(float(metrics[m.LOSS_POLICY]) + 0.1 * float(kl), rel=1e-6)
    assert float(metrics[m.POLICY_CLIP_FRAC]) == pytest.approx(float(clipped[MASK].mean()), rel=1e-6)
    assert float(metrics[m.POLICY_ENTROPY]) == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_objective(logp, old, adv, MASK, weights, means, clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1)
