"""Token sampling in distribution: temperature, top-k, top-p, greedy; keys per (seed, step, host)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from locojax.rollout import SamplingConfig, draw_from_cdf, rollout_key, sample_tokens, truncate_logits

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], np.float32)  # a tiny vocabulary, fixed logits
DRAWS = 40_000

# Upper 0.1% points of the chi-square distribution (any statistics table), used when scipy is absent.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution, computed independently of the code under test (plain numpy)."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    kept = np.zeros(len(logits), bool)
    kept[order[: top_k or len(logits)]] = True
    probs = np.where(kept, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    mass = 0.0
    for token in order:  # nucleus: most likely first, until the kept mass reaches top_p
        if not kept[token]:
            continue
        if mass >= top_p:
            kept[token] = False
        mass += probs[token]
    probs = np.where(kept, probs, 0.0)
    return probs / probs.sum()


def chi_square_critical(dof: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        return CHI2_999[dof]
    return float(chi2.ppf(0.999, dof))


def sample_counts(temperature: float, top_k: int, top_p: float, seed: int = 0) -> np.ndarray:
    sampling = SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, len(LOGITS)))
    # Eager on purpose: op-by-op compiles are cached across cases, one jit per case compiled the
    # random-bits kernel seven times (seconds each on this machine).
    tokens, _ = sample_tokens(logits, rollout_key(seed, 0, 0), sampling)
    return np.bincount(np.asarray(tokens), minlength=len(LOGITS))


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


CASES = [  # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (2.0, 0, 1.0),
    (1.0, 3, 1.0),
    (1.0, 0, 0.7),
    (0.8, 4, 0.8),
    (1.0, 0, 0.2),  # nucleus of one token
]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_sampling_matches_the_truncated_tempered_softmax(temperature, top_k, top_p):
    counts = sample_counts(temperature, top_k, top_p)
    probs = expected_probs(LOGITS, temperature, top_k, top_p)
    assert counts[probs == 0].sum() == 0, "sampled a token that top-k/top-p should have removed"
    if (probs > 0).sum() == 1:
        return
    statistic, dof = chi_square(counts, probs)
    assert statistic < chi_square_critical(dof), (counts, probs * DRAWS)


def test_the_chi_square_check_can_fail():
    # The same samples against a wrong target (temperature ignored) must be rejected, or the test
    # above proves nothing.
    counts = sample_counts(0.5, 0, 1.0)
    statistic, dof = chi_square(counts, expected_probs(LOGITS, 1.0, 0, 1.0))
    assert statistic > chi_square_critical(dof)


def test_per_row_keys_over_several_cdf_blocks_match_the_softmax():
    # What rollout does: one key per row, and a vocabulary of several 128-entry blocks (not a multiple
    # of the block), with a run of -inf entries straddling a block boundary that must never be drawn.
    vocab, draws = 300, 30_000
    logits = np.random.default_rng(1).normal(size=vocab).astype(np.float32)
    logits[120:140] = -np.inf
    keys = jax.random.split(rollout_key(2, 0, 0), draws)
    sampling = SamplingConfig(max_new_tokens=1, temperature=1.0)
    tokens, _ = jax.jit(lambda k, z: sample_tokens(z, k, sampling))(keys, jnp.broadcast_to(logits, (draws, vocab)))
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    assert counts[120:140].sum() == 0
    statistic, dof = chi_square(counts, probs)
    assert statistic < chi_square_critical(dof), statistic


def test_cdf_draw_picks_the_entry_whose_mass_holds_the_uniform():
    # Three equal weights: 1 - u in (2/3, 1] -> entry 2, (1/3, 2/3] -> entry 1, (0, 1/3] -> entry 0.
    logits = jnp.zeros((4, 3))
    uniform = jnp.array([0.0, 0.2, 0.5, 0.99])
    np.testing.assert_array_equal(draw_from_cdf(logits, uniform), [2, 2, 1, 0])
    masked = jnp.array([[0.0, -jnp.inf, 0.0, -jnp.inf]] * 2)  # never an entry of zero weight
    np.testing.assert_array_equal(draw_from_cdf(masked, jnp.array([0.0, 0.9999999])), [2, 0])


def test_truncation_keeps_the_top_token_and_ties():
    logits = jnp.array([[3.0, 1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(np.isfinite(truncate_logits(logits, 2, 1.0)), [[True, True, True, False]])
    np.testing.assert_array_equal(np.isfinite(truncate_logits(logits, 0, 1e-6)), [[True, False, False, False]])
    assert truncate_logits(logits, 0, 1.0) is logits  # nothing to do: no sort


def test_greedy_and_the_log_prob_convention():
    # The distribution tests' shape, so the eager random-bits kernel is reused rather than recompiled.
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(DRAWS, len(LOGITS))).astype(np.float32))
    rows = np.arange(DRAWS)
    greedy, greedy_logprob = sample_tokens(logits, rollout_key(0, 0, 0), SamplingConfig(1, temperature=0.0))
    np.testing.assert_array_equal(greedy, np.argmax(logits, -1))
    np.testing.assert_allclose(greedy_logprob, jax.nn.log_softmax(logits)[rows, greedy], atol=1e-6)
    # Sampled with truncation: the log-prob is of the tempered, *untruncated* distribution.
    sampling = SamplingConfig(1, temperature=0.7, top_k=3, top_p=0.9)
    tokens, logprobs = sample_tokens(logits, rollout_key(1, 0, 0), sampling)
    np.testing.assert_allclose(logprobs, jax.nn.log_softmax(logits / 0.7)[rows, tokens], atol=1e-6)
    assert np.asarray(logprobs).max() < 0 and len(np.unique(tokens)) > 1


def test_rollout_keys_never_repeat_across_steps_and_hosts():
    keys = {(s, h): jax.random.key_data(rollout_key(0, s, h)).tolist() for s in range(4) for h in range(4)}
    assert len({tuple(v) for v in keys.values()}) == 16
    assert jax.random.key_data(rollout_key(0, 2, 1)).tolist() == keys[(2, 1)]  # a restart repeats itself
    assert jax.random.key_data(rollout_key(1, 2, 1)).tolist() != keys[(2, 1)]


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(4, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(4, top_k=-2)


def test_sampling_config_from_the_run_spec():
    from locojax.spec import RolloutSpec
    from locojax.tokenizer import ByteTokenizer

    spec = RolloutSpec(max_new_tokens=20, temperature=0.7, top_p=0.9, top_k=5)
    sampling = SamplingConfig.from_spec(spec, ByteTokenizer())
    assert sampling == SamplingConfig(max_new_tokens=20, temperature=0.7, top_p=0.9, top_k=5, eos_id=257,
                                      pad_id=258)
    assert not sampling.greedy and SamplingConfig(1, temperature=0.0).greedy
