"""Rollout against the model's full forward pass: greedy tokens, log-probs, EOS handling, sharding.

Tiny preset on the 4 fake CPU devices of conftest.py; every compiled rollout is built once per
module (compiles dominate this file's time).
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from locojax.compiled_plan import program_temporaries
from locojax.model import create_model, forward, get_preset, positions_from_mask
from locojax.rollout import (
    SamplingConfig,
    decode_completions,
    decode_segments,
    default_decode_segments,
    encode_prompts,
    make_generate_fn,
    make_prefill_and_decode_fns,
    repeat_groups,
    rollout_key,
    rollout_mesh,
)
from locojax.tokenizer import ByteTokenizer

CONFIG = get_preset("tiny")
TOKENIZER = ByteTokenizer()
PROMPTS = ["Ann has 3 pens.\n", "1+2=", "a much longer prompt that gets truncated on the left\n", "x",
           "", "Bob had 17 toys and found 29. How many now?\n", "7-5=", "zz"]
PROMPT_LEN, NEW_TOKENS = 16, 12


@functools.lru_cache(maxsize=None)
def model():
    return nnx.split(create_model(CONFIG, seed=0))


@functools.lru_cache(maxsize=None)
def prompts():
    return encode_prompts(PROMPTS, TOKENIZER, PROMPT_LEN)


@functools.lru_cache(maxsize=None)
def rollout(temperature: float, eos_id: int | None, seed: int = 0):
    """A rollout of PROMPTS (host copy); one compile per sampling config, shared by the tests."""
    graphdef, params = model()
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=temperature, eos_id=eos_id,
                              pad_id=TOKENIZER.pad_id)
    generate = make_generate_fn(CONFIG, graphdef, sampling, PROMPT_LEN, len(PROMPTS))
    tokens, mask = prompts()
    return jax.device_get(generate(params, tokens, mask, rollout_key(seed, 0, 0)))


# One compiled full forward over P + N slots serves every reference computation below.
full_forward = jax.jit(forward, static_argnums=0)


def forward_logits(completion: np.ndarray, known: int) -> np.ndarray:
    """Logits [B, P + N, V] of one full forward pass (no cache) over prompt + completion[:, :known].

    The slots after `known` are padding; causality by slot keeps them from influencing the slots
    before, so the logits at slot P - 1 + i (predicting completion token i) are exact for i <= known.
    """
    graphdef, params = model()
    tokens, mask = prompts()
    visible = np.arange(NEW_TOKENS) < known
    sequence = np.concatenate([tokens, np.where(visible, completion, TOKENIZER.pad_id)], axis=1)
    full_mask = np.concatenate([mask, np.broadcast_to(visible, completion.shape)], axis=1)
    logits, _ = full_forward(graphdef, params, sequence, positions_from_mask(full_mask), full_mask)
    return np.asarray(logits)


def test_greedy_equals_step_by_step_argmax_of_the_full_forward():
    completion = np.full((len(PROMPTS), NEW_TOKENS), TOKENIZER.pad_id, np.int32)
    for i in range(NEW_TOKENS):  # no cache: the whole sequence so far through the model each step
        completion[:, i] = np.argmax(forward_logits(completion, i)[:, PROMPT_LEN - 1 + i], axis=-1)
    result = rollout(0.0, None)
    np.testing.assert_array_equal(result.tokens, completion)
    assert result.mask.all() and (result.lengths == NEW_TOKENS).all()
    assert len({tuple(row) for row in result.tokens}) > 1  # rows differ: the check is not vacuous


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_equal_a_fresh_forward_pass(temperature):
    result = rollout(temperature, None)
    logits = forward_logits(result.tokens, NEW_TOKENS)
    predicting = logits[:, PROMPT_LEN - 1:-1]  # position P-1+i predicts completion token i
    scale = temperature or 1.0  # greedy log-probs are of the T=1 distribution
    expected = np.take_along_axis(jax.nn.log_softmax(predicting / scale, axis=-1), result.tokens[..., None],
                                  axis=-1)[..., 0]
    np.testing.assert_allclose(result.logprobs, expected, atol=1e-4)


def test_eos_stops_a_row_and_masks_what_follows():
    greedy = rollout(0.0, None).tokens
    # Pretend EOS is the first token of row 0, from its fourth on, that the row has not emitted before.
    stop = next(i for i in range(3, NEW_TOKENS) if greedy[0, i] not in greedy[0, :i])
    eos = int(greedy[0, stop])
    result = rollout(0.0, eos)
    for row, tokens in enumerate(greedy):
        hits = np.flatnonzero(tokens == eos)
        length = hits[0] + 1 if len(hits) else NEW_TOKENS
        assert result.lengths[row] == length
        np.testing.assert_array_equal(result.tokens[row, :length], tokens[:length])  # same up to EOS
        assert (result.tokens[row, length:] == TOKENIZER.pad_id).all()
        np.testing.assert_array_equal(result.mask[row], np.arange(NEW_TOKENS) < length)
        assert (result.logprobs[row, length:] == 0).all()
    assert result.lengths[0] == stop + 1


def test_sampling_is_reproducible_per_key_and_varies_across_keys():
    first, again = rollout(1.0, None, seed=0), rollout(1.0, None, seed=0)
    other = rollout(1.0, None, seed=1)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert (first.tokens != other.tokens).mean() > 0.5
    assert (first.tokens != rollout(0.0, None).tokens).any()


@pytest.mark.usefixtures("four_cpu_devices")
def test_the_batch_is_sharded_over_local_devices():
    graphdef, params = model()
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=None, pad_id=TOKENIZER.pad_id)
    generate = make_generate_fn(CONFIG, graphdef, sampling, PROMPT_LEN, len(PROMPTS))
    assert make_generate_fn(CONFIG, graphdef, sampling, PROMPT_LEN, len(PROMPTS)) is generate  # jit once
    tokens, mask = prompts()
    result = generate(params, tokens, mask, rollout_key(0, 0, 0))
    assert len(result.tokens.sharding.device_set) == 4 == len(jax.local_devices())
    assert result.tokens.sharding.spec[0] == "data"
    assert rollout_mesh(6).devices.size == 3  # the most devices that divide the batch
    assert rollout_mesh(7).devices.size == 1


def test_prompt_and_completion_helpers():
    tokens, mask = encode_prompts(["ab", "abcdef"], TOKENIZER, 4)
    np.testing.assert_array_equal(tokens, [[258, 256, 97, 98], [99, 100, 101, 102]])  # left pad / truncate
    np.testing.assert_array_equal(repeat_groups(tokens, 2)[:, -1], [98, 98, 102, 102])
    result = rollout(0.0, int(rollout(0.0, None).tokens[0, 3]))
    texts = decode_completions(result, TOKENIZER)
    assert len(texts) == len(PROMPTS)
    assert texts[0] == TOKENIZER.decode(result.tokens[0, :4])


def test_max_seq_len_is_checked():
    graphdef, _ = model()
    with pytest.raises(ValueError, match="max_seq_len"):
        make_generate_fn(CONFIG, graphdef, SamplingConfig(max_new_tokens=CONFIG.max_seq_len), 8, 4)


@pytest.mark.usefixtures("four_cpu_devices")
def test_samples_depend_on_the_global_row_not_on_how_the_batch_is_split():
    """Per-row keys: one call over 8 rows on 4 devices == two calls over 4 rows on 1 device each with
    row offsets 0 and 4 (what 1 host x 4 devices and 2 hosts would do)."""
    graphdef, params = model()
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, eos_id=None, pad_id=TOKENIZER.pad_id)
    whole = rollout(1.0, None, seed=5)
    tokens, mask = prompts()
    halves = []
    for offset in (0, 4):
        generate = make_generate_fn(CONFIG, graphdef, sampling, PROMPT_LEN, 4, (jax.devices()[offset // 4],))
        halves.append(jax.device_get(generate(params, tokens[offset:offset + 4], mask[offset:offset + 4],
                                              rollout_key(5, 0, 0), offset)))
    np.testing.assert_array_equal(np.concatenate([h.tokens for h in halves]), whole.tokens)
    np.testing.assert_allclose(np.concatenate([h.logprobs for h in halves]), whole.logprobs, atol=1e-5)
    shifted = jax.device_get(make_generate_fn(CONFIG, graphdef, sampling, PROMPT_LEN, 4, (jax.devices()[0],))(
        params, tokens[:4], mask[:4], rollout_key(5, 0, 0), 4))
    assert not np.array_equal(shifted.tokens, halves[0].tokens), "the row offset must change the noise"


def test_prefill_then_decode_apart_is_the_generate_the_engine_runs():
    """bench/scale.py times the decode loop alone through the two halves jitted apart: they must sample
    what one generate call samples (EOS on, so the loop's stop condition is exercised too)."""
    graphdef, params = model()
    eos = int(rollout(1.0, None, seed=3).tokens[0, 3])  # row 0 stops by its 4th token
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, eos_id=eos, pad_id=TOKENIZER.pad_id)
    whole = rollout(1.0, eos, seed=3)
    assert whole.lengths[0] <= 4 and (whole.lengths < NEW_TOKENS).any()
    prefill, decode = make_prefill_and_decode_fns(CONFIG, graphdef, sampling, PROMPT_LEN, len(PROMPTS))
    tokens, mask = prompts()
    state = prefill(params, tokens, mask, rollout_key(3, 0, 0))
    assert int(state.step) == 1, "prefill samples the first token only"
    state = jax.device_get(decode(params, state))
    np.testing.assert_array_equal(state.tokens, whole.tokens)
    np.testing.assert_allclose(np.where(whole.mask, state.logprobs, 0.0), whole.logprobs, atol=1e-5)


def test_scanned_layers_sample_what_the_unrolled_ones_do():
    """Rollout with the layers under one scan (a stacked cache carried through it) against the unrolled
    layers: same tokens, same log-probs. The rollouts above ran the backend's default (unrolled on CPU,
    scanned on an accelerator); this one runs the other way, so both backends compare the two."""
    graphdef, params = model()
    other_config = CONFIG.replace(scan_layers=not CONFIG.scans_layers(jax.default_backend()))
    other_graphdef, other_params = nnx.split(create_model(other_config, seed=0))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), other_params, params))
    tokens, mask = prompts()
    for temperature in (0.0, 1.0):
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=temperature, eos_id=None,
                                  pad_id=TOKENIZER.pad_id)
        generate = make_generate_fn(other_config, other_graphdef, sampling, PROMPT_LEN, len(PROMPTS))
        other = jax.device_get(generate(params, tokens, mask, rollout_key(0, 0, 0)))
        default = rollout(temperature, None)
        np.testing.assert_array_equal(other.tokens, default.tokens)
        np.testing.assert_allclose(other.logprobs, default.logprobs, atol=1e-5)


def test_decode_segments_cover_every_step_and_read_only_the_slots_it_can_have_filled():
    for prompt_len, new_tokens, segments in [(16, 12, 3), (64, 128, 4), (5, 2, 4), (8, 1, 2), (3, 7, 1)]:
        plan = decode_segments(prompt_len, new_tokens, segments)
        steps, slots = new_tokens - 1, prompt_len + new_tokens - 1
        ends = [end for end, _ in plan]
        assert ends == sorted(set(ends)) and ends[-1] == steps and len(plan) <= segments
        previous = 0
        for end, window in plan:
            # every step of this loop (previous+1..end) writes slot P + step - 1 inside the window
            assert window == (slots if end == steps else prompt_len + end) and window <= slots
            assert all(prompt_len + step - 1 < window for step in range(previous + 1, end + 1))
            previous = end
    assert decode_segments(64, 128, 4) == [(32, 96), (64, 128), (96, 160), (127, 191)]
    with pytest.raises(ValueError, match="segments"):
        decode_segments(4, 4, 0)
    assert default_decode_segments(128, "cpu") == 1  # the CPU compiles one loop
    assert [default_decode_segments(n, "tpu") for n in (2, 64, 128, 256)] == [1, 1, 3, 4]


@pytest.mark.parametrize("eos, other_layer_form", [(False, False), (True, True)])
def test_segmented_decode_samples_what_one_loop_does(eos, other_layer_form):
    """Decode loops that each read only the slots their steps can have filled sample the tokens and
    log-probs of one loop over the whole cache: with EOS off, and on with rows stopping in different
    segments (a segment whose rows are all done exits at once); with the backend's layer form
    (unrolled on CPU) and the other one (a stacked cache, whose window is one dynamic slice)."""
    config, graphdef = CONFIG, model()[0]
    params = model()[1]
    if other_layer_form:
        config = CONFIG.replace(scan_layers=not CONFIG.scans_layers(jax.default_backend()))
        graphdef = nnx.split(create_model(config, seed=0))[0]
    eos_id = int(rollout(1.0, None, seed=3).tokens[0, 5]) if eos else None
    one_loop = rollout(1.0, eos_id, seed=3)
    if eos:
        assert one_loop.lengths.min() <= 6 and (one_loop.lengths < NEW_TOKENS).any()
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, eos_id=eos_id, pad_id=TOKENIZER.pad_id)
    generate = make_generate_fn(config, graphdef, sampling, PROMPT_LEN, len(PROMPTS), segments=3)
    assert generate.segments == 3 and len(decode_segments(PROMPT_LEN, NEW_TOKENS, 3)) == 3
    tokens, mask = prompts()
    segmented = jax.device_get(generate(params, tokens, mask, rollout_key(3, 0, 0)))
    np.testing.assert_array_equal(segmented.tokens, one_loop.tokens)
    np.testing.assert_array_equal(segmented.lengths, one_loop.lengths)
    np.testing.assert_allclose(segmented.logprobs, one_loop.logprobs, atol=1e-5)


# Unrolled, the decode loop's program on a v5e held 8.9 MB beyond its arguments against a 7.0 MB cache
# (f4e92159; counted as the plan counts a TPU's programs, where temp_size_in_bytes had said 0). Accelerators
# run deep models scanned (`scan_layers: auto`), which keeps the cache in place there too.
@pytest.mark.parametrize("scan_layers", [
    pytest.param(False, marks=pytest.mark.xfail(jax.default_backend() == "tpu", strict=True,
                                                reason="unrolled on a v5e the decode loop copies its cache (f4e92159)")),
    True])
def test_the_decode_loop_updates_the_cache_in_place(scan_layers):
    """The decode loop writes each token's keys and values into the cache it carries, never into a copy:
    its temporary memory stays below half the cache (a copy per step, or a cache rebuilt by the layer
    scan, would need all of it). The cache here is 6x the weights, which the unrolled loop slices once."""
    config = CONFIG.replace(n_layers=4, scan_layers=scan_layers)
    graphdef, params = nnx.split(create_model(config, seed=0))
    batch, new_tokens = 32, 200
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, eos_id=None, pad_id=TOKENIZER.pad_id)
    prefill, decode = make_prefill_and_decode_fns(config, graphdef, sampling, PROMPT_LEN, batch, jax.devices()[:1])
    state = jax.eval_shape(prefill, params, *(np.zeros((batch, PROMPT_LEN), dtype) for dtype in (np.int32, bool)),
                           rollout_key(0, 0, 0))
    cache_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.cache))
    weight_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    assert cache_bytes > 5 * weight_bytes
    temporaries = program_temporaries(decode.lower(params, state).compile().memory_analysis(), jax.devices()[0].platform)
    assert 0 < temporaries < cache_bytes / 2, (temporaries, cache_bytes)
