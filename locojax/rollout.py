"""Rollout: one jitted function per (batch, prompt length, sampling config) that samples completions.

Prefill writes the left-padded prompts into the KV cache (`locojax.model.Cache`); a
`lax.while_loop` then decodes one token per iteration until every row has emitted EOS or
`max_new_tokens` is reached. The whole loop runs inside one XLA computation, so the host pays one
dispatch per rollout, not one per token (STYLE habit 2). The decode state is a single `DecodeState`
pytree carried by the loop. Because the state (KV cache included) is created inside the computation
and is the loop's carry, XLA updates it in place with no buffer to donate across the call boundary
— the effect Tunix gets by donating its state to separate prefill and decode jits, without the
second dispatch.

Data parallel over the host's *local* devices only: the batch is sharded over a 1-D mesh of
`jax.local_devices()` (params replicated), so a rollout never causes cross-host traffic
(DESIGN §5 step 2).

Log-prob convention (verl, TRL): `logprobs[b, i] = log softmax(logits / T)[token]` — the tempered
distribution *before* top-k/top-p truncation, so a trainer recomputes it exactly from a forward
pass with the same temperature. At T = 0 (greedy) it is `log softmax(logits)[token]`.

Shapes: B batch (prompts x group size), P prompt slots, N max new tokens, S = P + N - 1 cache
slots, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from locojax.model import (Cache, ModelConfig, fold_adapters_for_rollout, forward, init_cache, layer_params,
                           positions_from_mask)
from locojax.tokenizer import Tokenizer, pad_left

if TYPE_CHECKING:
    from locojax.spec import RolloutSpec


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. `eos_id=None` never stops early (benchmarks: every row decodes N tokens)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    eos_id: int | None = 257
    pad_id: int = 258

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_spec(cls, rollout: "RolloutSpec", tokenizer: Tokenizer) -> "SamplingConfig":
        """From a `locojax.spec.RolloutSpec` and the run's tokenizer (for EOS and PAD)."""
        return cls(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                   top_k=rollout.top_k, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)


@flax.struct.dataclass
class RolloutResult:
    tokens: jax.Array  # [B, N] int32: sampled tokens, pad_id after EOS
    logprobs: jax.Array  # [B, N] float32: log softmax(logits / T) of each sampled token; 0 where not mask
    mask: jax.Array  # [B, N] bool: completion tokens, the EOS included
    lengths: jax.Array  # [B] int32: completion lengths (= mask.sum(-1))


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries from one token to the next."""

    step: jax.Array  # [] int32: tokens sampled so far; the next one goes to column `step`
    cache: Cache  # every layer's keys and values for S slots (its layout: locojax.model.Cache)
    kv_mask: jax.Array  # [B, S] bool: cache slots holding real tokens
    last_token: jax.Array  # [B] int32: the token to feed next (sampled, not yet in the cache)
    position: jax.Array  # [B] int32: rotary position of last_token
    tokens: jax.Array  # [B, N] int32
    logprobs: jax.Array  # [B, N] float32
    done: jax.Array  # [B] bool: the row has emitted EOS
    key: jax.Array  # [B] per-row PRNG keys; token i of a row samples with fold_in(key, i)


# ---------------------------------------------------------------------------------------------
# Sampling: pure functions of logits, shared by the decode loop and the distribution tests.


def truncate_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Set logits outside the top-k, then outside the top-p nucleus, to -inf. logits: [B, V].

    Top-p keeps the smallest set of most likely tokens whose (top-k renormalised) mass reaches
    `top_p`; the most likely token is always kept. Ties at a threshold are all kept.
    """
    vocab = logits.shape[-1]
    use_top_k = 0 < top_k < vocab
    if not use_top_k and top_p >= 1.0:
        return logits
    if top_p >= 1.0:  # top-k alone needs only the k-th largest value, not a full sort
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        return jnp.where(logits >= kth, logits, -jnp.inf)
    descending = -jnp.sort(-logits, axis=-1)  # [B, V]
    if use_top_k:
        descending = jnp.where(jnp.arange(vocab) < top_k, descending, -jnp.inf)
    probs = jax.nn.softmax(descending, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    keep = mass_before < top_p
    threshold = jnp.min(jnp.where(keep, descending, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_tokens(logits: jax.Array, key: jax.Array, sampling: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-prob (see the module docstring). logits: [B, V] float32.

    `key` is one key for the whole batch, or a [B] array of per-row keys (what rollout uses, so a
    row's sample does not depend on which host or device drew it)."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        tokens = jnp.argmax(logits, axis=-1)
        scaled = logits
    else:
        scaled = logits / sampling.temperature
        truncated = truncate_logits(scaled, sampling.top_k, sampling.top_p)
        if key.ndim == 0:
            uniform = jax.random.uniform(key, logits.shape[:1])
        else:
            uniform = jax.vmap(jax.random.uniform)(key)
        tokens = draw_from_cdf(truncated, uniform)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), logprobs


_CDF_BLOCK = 128


def draw_from_cdf(logits: jax.Array, uniform: jax.Array) -> jax.Array:
    """One token per row of softmax(logits) ([B, V], -inf = never), by inverting its cumulative
    distribution at `uniform` ([B] in [0, 1)): one random number per row.

    jax.random.categorical draws a Gumbel number per vocabulary entry instead: 2.4M threefry draws a
    step at 16 rows x 151,936 entries, 60 ms here against 2 ms for this. The cumulative sum is taken
    in two levels (block totals, then within the chosen block of 128), which keeps it short and its
    float32 rounding small. Only an entry with positive weight can be drawn."""
    batch, vocab = logits.shape
    blocks = -(-vocab // _CDF_BLOCK)
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # the top entry weighs 1
    weights = jnp.pad(weights, ((0, 0), (0, blocks * _CDF_BLOCK - vocab))).reshape(batch, blocks, _CDF_BLOCK)
    block_mass = weights.sum(axis=-1)  # [B, blocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    # 1 - u lies in (0, 1], so the target is positive and at most the total: the first block whose
    # cumulative mass reaches it exists and has positive mass.
    target = (1.0 - uniform) * block_cdf[:, -1]
    block = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), blocks - 1)
    inside = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [B, block]
    before = jnp.take_along_axis(block_cdf - block_mass, block[:, None], axis=1)
    reached = (before + jnp.cumsum(inside, axis=-1) >= target[:, None]) & (inside > 0)
    # Rounding can leave the block's own sum a hair below the target: take its last positive entry then.
    last_positive = _CDF_BLOCK - 1 - jnp.argmax((inside > 0)[:, ::-1], axis=-1)
    offset = jnp.where(reached.any(axis=-1), jnp.argmax(reached, axis=-1), last_positive)
    return block * _CDF_BLOCK + offset


# ---------------------------------------------------------------------------------------------
# Keys, meshes, prompt helpers.


_ROLLOUT_STREAM = 0x5A3D  # keeps rollout noise apart from any other use of PRNGKey(seed)


def rollout_key(seed: int, step: int, host: int = 0) -> jax.Array:
    """The sampling key of (seed, step): the same on every host and on a restart.

    Generate derives each row's own key from it and the row's *global* index (`row_offset` +
    position in the call), so a sample depends on (seed, step, row) only — not on how many hosts
    or devices share the batch: 2 hosts x 1 device and 1 host x 2 devices draw identical samples.
    Threefry keys are used because their bits do not depend on sharding. `host` is kept for callers
    that want separate streams per host (it is folded in when non-zero).
    """
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _ROLLOUT_STREAM), step)
    return jax.random.fold_in(key, host) if host else key


def rollout_mesh(batch: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """1-D ("data",) mesh over this host's devices: the most of them that divide `batch` evenly."""
    devices = list(devices if devices is not None else jax.local_devices())
    count = max(d for d in range(1, len(devices) + 1) if batch % d == 0)
    # Auto axis types: this jax defaults make_mesh to Explicit, which rejects the model's
    # replicated-weights contractions (PITFALLS.md).
    return Mesh(np.array(devices[:count]), ("data",), axis_types=(AxisType.Auto,))


def repeat_groups(array: np.ndarray, group_size: int) -> np.ndarray:
    """Each row `group_size` times in a row ([B, ...] -> [B * G, ...]): one GRPO group per prompt."""
    return np.repeat(array, group_size, axis=0)


def encode_prompts(prompts: Sequence[str], tokenizer: Tokenizer, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """BOS + prompt text, left-padded (and left-truncated) to `prompt_len`: tokens, mask [B, P]."""
    return pad_left([tokenizer.encode(p, add_bos=True) for p in prompts], prompt_len, tokenizer.pad_id)


def decode_completions(result: RolloutResult, tokenizer: Tokenizer) -> list[str]:
    """Completion texts (EOS and padding dropped) from a rollout result."""
    tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
    return [tokenizer.decode(row[:length]) for row, length in zip(tokens, lengths)]


# ---------------------------------------------------------------------------------------------
# The jitted generate function.


def _completion_mask(tokens: jax.Array, eos_id: int | None) -> tuple[jax.Array, jax.Array]:
    """mask [B, N] (up to and including the first EOS) and lengths [B]."""
    n = tokens.shape[1]
    if eos_id is None:
        lengths = jnp.full(tokens.shape[:1], n, jnp.int32)
    else:
        is_eos = tokens == eos_id
        lengths = jnp.where(is_eos.any(axis=-1), jnp.argmax(is_eos, axis=-1) + 1, n).astype(jnp.int32)
    return jnp.arange(n)[None, :] < lengths[:, None], lengths


def _prefill(graphdef, params, prompt_tokens, prompt_mask, key, row_offset, *, config: ModelConfig,
             sampling: SamplingConfig, batch_sharding: NamedSharding) -> DecodeState:
    """The prompt in one pass into a fresh KV cache, and the first sampled token: the decode loop's start."""
    batch, prompt_len = prompt_tokens.shape
    n = sampling.max_new_tokens
    slots = prompt_len + n - 1  # the last sampled token is never fed back into the cache
    eos = -1 if sampling.eos_id is None else sampling.eos_id  # -1 never matches a token id

    def constrain(tree):
        return jax.lax.with_sharding_constraint(tree, batch_sharding)

    # Prefill: the whole prompt in one pass, writing slots [0, P) of the cache. Only the last slot's
    # logits are needed: the full [B, P, V] ones were 0.9 GB and 0.5 TFLOP at 0.6B (16 rows x 96 slots).
    cache = init_cache(config, batch, slots).batch_sharded(batch_sharding)
    kv_mask = jnp.concatenate([prompt_mask, jnp.zeros((batch, slots - prompt_len), bool)], axis=1)  # [B, S]
    logits, cache = forward(graphdef, params, prompt_tokens, positions_from_mask(prompt_mask), kv_mask, cache, 0,
                            output_slots=(prompt_len - 1, prompt_len))
    row_keys = constrain(jax.vmap(lambda row: jax.random.fold_in(key, row))(row_offset + jnp.arange(batch)))
    first, first_logprob = sample_tokens(logits[:, -1], _token_keys(row_keys, 0), sampling)  # last slot is real
    return DecodeState(
        step=jnp.array(1, jnp.int32),
        cache=cache,
        kv_mask=kv_mask,
        last_token=first,
        position=prompt_mask.sum(axis=-1).astype(jnp.int32),  # the prompt used positions [0, len)
        tokens=constrain(jnp.full((batch, n), sampling.pad_id, jnp.int32).at[:, 0].set(first)),
        logprobs=constrain(jnp.zeros((batch, n), jnp.float32).at[:, 0].set(first_logprob)),
        done=first == eos,
        key=row_keys,
    )


# Row keys and a token index -> that token's [B] keys.
_token_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))


def decode_segments(prompt_len: int, max_new_tokens: int, segments: int) -> list[tuple[int, int]]:
    """(last step, cache window) of each of `segments` decode loops that share the decode's steps.

    Step i (1 <= i < N) writes slot P + i - 1 and attends to slots [0, P + i), so a loop whose steps
    end at step e reads a window of P + e slots instead of the cache's P + N - 1: over N new tokens
    split in k equal loops, attention reads P + N (k + 1) / 2k slots a step on average instead of
    P + N. Fewer segments than asked where the decode has fewer steps."""
    if segments < 1:
        raise ValueError(f"decode segments must be >= 1, got {segments}")
    steps = max_new_tokens - 1
    slots = prompt_len + steps
    ends = sorted({math.ceil(steps * (k + 1) / segments) for k in range(segments)} - {0}) or [0]
    return [(end, slots if end == steps else prompt_len + end) for end in ends]


# Decode segments per platform (the default of `make_generate_fn`): on an accelerator the attention
# products stream the cache at the memory's bandwidth, so every empty slot read is time; each
# segment is one more decode loop to compile (`decode_segments`). XLA:CPU keeps one loop: it unrolls
# the layers, so each loop is a whole model to compile, and the CPU's runs (tests, the demo) compile
# many small rollouts for short decodes.
DECODE_SEGMENTS: dict[str, int] = {"cpu": 1}
DEFAULT_DECODE_SEGMENTS = 4
MIN_SEGMENT_STEPS = 32  # fewer steps a loop save too few slot reads to be worth one more loop


def default_decode_segments(max_new_tokens: int, platform: str | None = None) -> int:
    """How many decode loops a rollout of `max_new_tokens` runs on `platform` (default: JAX's backend)."""
    wanted = DECODE_SEGMENTS.get(platform or jax.default_backend(), DEFAULT_DECODE_SEGMENTS)
    return max(1, min(wanted, (max_new_tokens - 1) // MIN_SEGMENT_STEPS))


def _decode(graphdef, params, state: DecodeState, *, prompt_len: int, sampling: SamplingConfig,
            segments: int = 1) -> DecodeState:
    """One token per iteration from `_prefill`'s state until every row has emitted EOS or N tokens exist.

    The steps run as `segments` loops one after the other (`decode_segments`), each reading only the
    cache slots its steps can have filled; a loop whose rows are all done exits at once, and so do the
    ones after it. Same tokens and log-probs as one loop over the whole cache: the slots a segment
    leaves out are masked out of every softmax anyway."""
    batch, n = state.tokens.shape
    eos = -1 if sampling.eos_id is None else sampling.eos_id

    # Sliced out of the stacked parameters once, not per token: XLA does not hoist the slices out of
    # the loop, and on XLA:CPU each is a copy of the layer's weights.
    layers = layer_params(graphdef, params)

    def decode_one(state: DecodeState) -> DecodeState:
        slot = prompt_len + state.step - 1  # where last_token goes in the cache
        kv_mask = jax.lax.dynamic_update_slice(state.kv_mask, jnp.ones((batch, 1), bool), (0, slot))
        logits, cache = forward(graphdef, params, state.last_token[:, None], state.position[:, None], kv_mask,
                                state.cache, slot, layers=layers)
        token, logprob = sample_tokens(logits[:, 0], _token_keys(state.key, state.step), sampling)
        # Rows that already finished keep emitting padding (their work is wasted but shapes stay static).
        token = jnp.where(state.done, sampling.pad_id, token)
        logprob = jnp.where(state.done, 0.0, logprob)
        return DecodeState(
            step=state.step + 1,
            cache=cache,
            kv_mask=kv_mask,
            last_token=token,
            position=state.position + 1,
            tokens=jax.lax.dynamic_update_slice(state.tokens, token[:, None], (0, state.step)),
            logprobs=jax.lax.dynamic_update_slice(state.logprobs, logprob[:, None], (0, state.step)),
            done=state.done | (token == eos),
            key=state.key,
        )

    full_window = state.cache.window
    for last_step, window in decode_segments(prompt_len, n, segments):
        def keep_going(state: DecodeState, last_step=last_step) -> jax.Array:
            return (state.step <= last_step) & (state.step < n) & ~jnp.all(state.done)

        state = state.replace(cache=state.cache.windowed(window))
        state = jax.lax.while_loop(keep_going, decode_one, state)
    return state.replace(cache=state.cache.windowed(full_window))


def _result(state: DecodeState, sampling: SamplingConfig) -> RolloutResult:
    mask, lengths = _completion_mask(state.tokens, sampling.eos_id)
    return RolloutResult(tokens=state.tokens, logprobs=jnp.where(mask, state.logprobs, 0.0), mask=mask,
                         lengths=lengths)


def _generate(graphdef, params, prompt_tokens, prompt_mask, key, row_offset, *, config: ModelConfig,
              sampling: SamplingConfig, batch_sharding: NamedSharding, segments: int) -> RolloutResult:
    graphdef, params = fold_adapters_for_rollout(graphdef, params)  # once for the whole rollout (LoRA "merged")
    state = _prefill(graphdef, params, prompt_tokens, prompt_mask, key, row_offset, config=config,
                     sampling=sampling, batch_sharding=batch_sharding)
    state = _decode(graphdef, params, state, prompt_len=prompt_tokens.shape[1], sampling=sampling,
                    segments=segments)
    return _result(state, sampling)


GenerateFn = Callable[[nnx.State, jax.Array, jax.Array, jax.Array], RolloutResult]


def _rollout_shardings(config: ModelConfig, sampling: SamplingConfig, prompt_len: int, batch: int,
                       devices: tuple[jax.Device, ...] | None) -> tuple[NamedSharding, NamedSharding]:
    """Checks the shapes; the batch's and the (replicated) params' shardings on `rollout_mesh`."""
    if prompt_len < 1 or batch < 1:
        raise ValueError(f"prompt_len and batch must be >= 1, got {prompt_len}, {batch}")
    if prompt_len + sampling.max_new_tokens - 1 > config.max_seq_len:
        raise ValueError(f"prompt_len + max_new_tokens - 1 = {prompt_len + sampling.max_new_tokens - 1} cache "
                         f"slots exceed the model's max_seq_len {config.max_seq_len}")
    mesh = rollout_mesh(batch, devices)
    return NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())


@functools.lru_cache(maxsize=32)
def make_generate_fn(config: ModelConfig, graphdef: nnx.GraphDef, sampling: SamplingConfig, prompt_len: int,
                     batch: int, devices: tuple[jax.Device, ...] | None = None,
                     segments: int | None = None) -> GenerateFn:
    """`generate(params, prompt_tokens [B, P], prompt_mask [B, P], key, row_offset=0) -> RolloutResult`, jitted.

    `segments`: decode loops, each reading only the cache slots its steps can have filled
    (`decode_segments`; default `default_decode_segments` for the devices' platform).
    Cached per arguments, so asking again for the same shapes returns the same compiled function.
    The batch is sharded over `rollout_mesh(batch, devices)`; params are replicated on it (numpy
    or uncommitted inputs are moved there by jit; params committed elsewhere must be placed with
    `jax.device_put(params, NamedSharding(mesh, PartitionSpec()))` first).
    """
    batch_sharding, replicated = _rollout_shardings(config, sampling, prompt_len, batch, devices)
    segments = _segments_for(segments, sampling, batch_sharding)
    body = functools.partial(_generate, graphdef, config=config, sampling=sampling, batch_sharding=batch_sharding,
                             segments=segments)
    jitted = jax.jit(body, in_shardings=(replicated, batch_sharding, batch_sharding, replicated, replicated),
                     out_shardings=batch_sharding)

    def generate(params, prompt_tokens, prompt_mask, key, row_offset: int | jax.Array = 0) -> RolloutResult:
        """`row_offset`: the global index of this call's first row (its host's offset in the step); an int32
        scalar already on the rollout mesh saves the call a transfer (`RolloutRunner.prepare`)."""
        # This host's rows onto its rollout mesh first: in a multi-process job jit refuses numpy inputs
        # with a non-replicated sharding (it cannot tell they are this process's own rows).
        prompt_tokens, prompt_mask = jax.device_put((prompt_tokens, prompt_mask), batch_sharding)
        return jitted(params, prompt_tokens, prompt_mask, key,
                      row_offset if isinstance(row_offset, jax.Array) else np.int32(row_offset))

    # For compiling ahead of time from abstract arguments (locojax.compiled_plan): the program the calls run.
    generate.jitted, generate.batch_sharding, generate.segments = jitted, batch_sharding, segments
    return generate


def _segments_for(segments: int | None, sampling: SamplingConfig, batch_sharding: NamedSharding) -> int:
    if segments is None:
        platform = next(iter(batch_sharding.mesh.devices.flat)).platform
        return default_decode_segments(sampling.max_new_tokens, platform)
    if segments < 1:
        raise ValueError(f"decode segments must be >= 1, got {segments}")
    return segments


def make_prefill_and_decode_fns(config: ModelConfig, graphdef: nnx.GraphDef, sampling: SamplingConfig,
                                prompt_len: int, batch: int, devices: tuple[jax.Device, ...] | None = None,
                                segments: int | None = None):
    """The two halves of `make_generate_fn`'s function, jitted apart, so the decode loop can be timed
    without the prefill (bench/scale.py; the difference of two whole generate calls was dominated by
    the prefill's noise on a shared CPU):

        prefill(params, prompt_tokens, prompt_mask, key, row_offset=0) -> DecodeState
        decode(params, state) -> DecodeState   (state is donated: the cache is updated in place)

    The engine itself runs them in one computation (one dispatch per rollout). Same validation and
    placement as `make_generate_fn`."""
    batch_sharding, replicated = _rollout_shardings(config, sampling, prompt_len, batch, devices)
    def folded(half):  # each half folds LoRA "merged" adapters in itself (once per call)
        return lambda graphdef, params, *args, **kwargs: half(*fold_adapters_for_rollout(graphdef, params),
                                                               *args, **kwargs)

    prefill_jitted = jax.jit(functools.partial(folded(_prefill), graphdef, config=config, sampling=sampling,
                                               batch_sharding=batch_sharding),
                             in_shardings=(replicated, batch_sharding, batch_sharding, replicated, replicated))
    segments = _segments_for(segments, sampling, batch_sharding)
    decode = jax.jit(functools.partial(folded(_decode), graphdef, prompt_len=prompt_len, sampling=sampling,
                                       segments=segments), donate_argnums=1)

    def prefill(params, prompt_tokens, prompt_mask, key, row_offset: int = 0) -> DecodeState:
        prompt_tokens, prompt_mask = jax.device_put((prompt_tokens, prompt_mask), batch_sharding)
        return prefill_jitted(params, prompt_tokens, prompt_mask, key, np.int32(row_offset))

    return prefill, decode
