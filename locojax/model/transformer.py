"""The Qwen3-architecture decoder (and its Llama-3.1 sibling) in Flax NNX.

One pass handles three uses: a full causal forward for training (`cache=None`), a prefill that
writes a left-padded prompt batch into the KV cache, and one-token decode steps. Which key slots a
query may see is decided by two things only: `kv_mask` (which cache slots hold real tokens — pads
are False) and causality by slot index. Rotary positions come in separately as `positions`, so a
left-padded row's first real token sits at position 0 whatever slot it occupies.

Parameters carry *logical* axis names in their `axes` metadata (`embed`, `heads`, `mlp`, ...);
`locojax.model.sharding` maps them to mesh axes with one rules table. Every projection is stored
[out, in] (the Hugging Face / PyTorch layout): a decode step multiplies each weight by a few rows,
and XLA:CPU streams a weight whose contracted axis is contiguous 1.5-2x faster (`_linear`).

Shapes: B batch, T new tokens this call, S cache slots, D d_model, H heads, K kv heads,
G = H/K query heads per kv head, Dh head_dim, F d_ff, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from locojax.model.config import ModelConfig

# Per-layer (keys, values), each [B, K, S, Dh]. A list of per-layer arrays updated with
# dynamic_update_slice beat one stacked array by 1.6-2.6x (PITFALLS.md).
LayerCache = tuple[jax.Array, jax.Array]
Cache = list[LayerCache]

_MASKED = -1e30  # finite so a fully masked row (a pad query) gives a uniform softmax, not NaN


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], fan_in: int, dtype: str) -> nnx.Param:
    init = jax.random.normal(rngs.params(), shape, jnp.float32) * (fan_in**-0.5)
    return nnx.Param(init.astype(_dtype(dtype)), axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: str, axis_name: str = "norm"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), _dtype(dtype)), axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)  # statistics in float32 whatever the compute dtype
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float,
                num_positions: int | None = None) -> tuple[jax.Array, jax.Array]:
    """sin, cos of the rotary angles: [B, T, Dh/2] each.

    With `num_positions`, every position must be below it: sin and cos are then tabulated once for
    positions 0..num_positions-1 and gathered (same values). XLA:CPU otherwise fuses sin/cos into
    every rotary application — q and k of every layer, forward and backward — and recomputes them
    per element there."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if num_positions is None:
        angles = positions.astype(jnp.float32)[..., None] * inv_freq
        return jnp.sin(angles), jnp.cos(angles)
    angles = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv_freq  # [num_positions, Dh/2]
    return jnp.take(jnp.sin(angles), positions, axis=0), jnp.take(jnp.cos(angles), positions, axis=0)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate halves (the Hugging Face / Qwen3 convention, not interleaved pairs). x: [B, T, N, Dh]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _linear(x2: jax.Array, weight: jax.Array, dt, decode: bool = False) -> jax.Array:
    """x2 [N, in] times a weight stored [out, in]: [N, out].

    Flattening batch and time first matters on XLA:CPU: a 3-D einsum's backward contracts over both
    and ran ~20% slower (bench/grpo_step.py). `decode` (a one-token step: N is the batch, a few
    rows): computed as weight @ x2.T, which reads the weight row by row; asked for as x2 @ weight.T,
    XLA:CPU ran the layers' matmuls 1.5x and the vocabulary head 2x slower at 16 rows. The
    optimization barrier keeps the simplifier from folding the final (small) transpose back into
    the dot. Not for training: nothing is differentiated through it."""
    w = weight.astype(dt)
    if decode:
        return jax.lax.optimization_barrier(w @ x2.T).T
    return x2 @ w.T


@jax.custom_vjp
def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up. Its backward keeps only gate and up and recomputes the sigmoid inside one fused
    pass; autodiff of silu kept extra [N, F] intermediates alive for the backward (the bench's train
    step needed 9% more temporary memory, which XLA:CPU page-faults in afresh on every call)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return _swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, grad):
    gate, up = residuals
    g32, u32, d32 = gate.astype(jnp.float32), up.astype(jnp.float32), grad.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    d_gate = d32 * u32 * sig * (1.0 + g32 * (1.0 - sig))  # d silu(x)/dx = s + x s (1 - s)
    d_up = d32 * g32 * sig
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.config = config
        pd = c.param_dtype
        self.q_proj = _param(rngs, (c.n_heads, c.head_dim, c.d_model), ("heads", "head_dim", "embed"), c.d_model, pd)
        self.k_proj = _param(rngs, (c.n_kv_heads, c.head_dim, c.d_model), ("kv_heads", "head_dim", "embed"),
                             c.d_model, pd)
        self.v_proj = _param(rngs, (c.n_kv_heads, c.head_dim, c.d_model), ("kv_heads", "head_dim", "embed"),
                             c.d_model, pd)
        self.o_proj = _param(rngs, (c.d_model, c.n_heads, c.head_dim), ("embed", "heads", "head_dim"),
                             c.n_heads * c.head_dim, pd)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps, pd, "head_dim")
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps, pd, "head_dim")

    def __call__(self, x, sin, cos, mask, layer_cache: LayerCache | None, cache_index,
                 query_slots: tuple[int, int] | None = None, decode: bool = False):
        """`query_slots` (start, stop): keys and values of all T slots (written to the cache when there
        is one), but queries (and so the output, [B, stop-start, D]) only for slots start..stop-1;
        `mask` is still [B, T, S].
        `decode`: this is a one-token step on a cache (the caller decides it once for every layer)."""
        c = self.config
        dt = _dtype(c.dtype)
        b, t = x.shape[:2]
        x2 = x.astype(dt).reshape(b * t, c.d_model)
        k = _linear(x2, self.k_proj[...].reshape(-1, c.d_model), dt, decode)
        v = _linear(x2, self.v_proj[...].reshape(-1, c.d_model), dt, decode)
        if query_slots is None:
            q = _linear(x2, self.q_proj[...].reshape(-1, c.d_model), dt, decode)
            sin_q, cos_q = sin, cos
        else:
            start, stop = query_slots
            q_rows = x[:, start:stop].astype(dt).reshape(-1, c.d_model)
            q = _linear(q_rows, self.q_proj[...].reshape(-1, c.d_model), dt)
            sin_q, cos_q, mask = sin[:, start:stop], cos[:, start:stop], mask[:, start:stop]
        tq = q.shape[0] // b
        q = q.reshape(b, tq, c.n_heads, c.head_dim)  # [B, Tq, H, Dh]
        k = k.reshape(b, t, c.n_kv_heads, c.head_dim)  # [B, T, K, Dh]
        v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, sin_q, cos_q), apply_rope(k, sin, cos)

        q = q.reshape(b, tq, c.n_kv_heads, c.q_per_kv, c.head_dim)  # [B, Tq, K, G, Dh]
        v = v.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
        if layer_cache is None:
            k = k.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
            scores = jnp.einsum("btkgh,bksh->bkgts", q, k)
        else:
            # A cache keeps keys as [B, K, Dh, S] and values as [B, K, S, Dh], and both attention
            # products are written as dot_generals with the few query rows (Tq x G) on the left:
            # q [G, Dh] @ keys [Dh, S], then probs [G, S] @ values [S, Dh], each reading its cache
            # in place with the slots as the long, contiguous axis. Keys slot-major like the values
            # made XLA:CPU run the scores 2x slower (a batched dot with the cache on the left), and
            # the same products as einsums let it put the cache on the left and contract over its
            # second-minor axis, 4x slower still. At 0.6B and 16 rows this cut the decode step's
            # attention from ~55 to ~35 ms (bench/scale.py).
            cache_k, cache_v = layer_cache
            k = jax.lax.dynamic_update_slice(cache_k, k.transpose(0, 2, 3, 1).astype(cache_k.dtype),
                                             (0, 0, 0, cache_index))
            v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, 0, cache_index, 0))
            layer_cache = (k, v)
            q_rows = q.transpose(0, 2, 1, 3, 4).reshape(b, c.n_kv_heads, tq * c.q_per_kv, c.head_dim)
            scores = jax.lax.dot_general(q_rows, k.astype(dt), (((3,), (2,)), ((0, 1), (0, 1))))
            scores = scores.reshape(b, c.n_kv_heads, tq, c.q_per_kv, -1).transpose(0, 1, 3, 2, 4)
        scores = scores.astype(jnp.float32) * (c.head_dim**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        if layer_cache is None:
            out = jnp.einsum("bkgts,bksh->btkgh", probs, v.astype(dt)).reshape(b * tq, c.n_heads * c.head_dim)
        else:
            p_rows = probs.transpose(0, 1, 3, 2, 4).reshape(b, c.n_kv_heads, tq * c.q_per_kv, -1)
            out = jax.lax.dot_general(p_rows, v.astype(dt), (((3,), (2,)), ((0, 1), (0, 1))))  # [B, K, Tq*G, Dh]
            out = out.reshape(b, c.n_kv_heads, tq, c.q_per_kv, c.head_dim).transpose(0, 2, 1, 3, 4)
            out = out.reshape(b * tq, c.n_heads * c.head_dim)
        o_proj = self.o_proj[...].reshape(c.d_model, c.n_heads * c.head_dim)
        return _linear(out, o_proj, dt, decode).reshape(b, tq, c.d_model), layer_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), on [B*T, D] for the reason `_project` gives."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.dtype = c.dtype
        self.gate_proj = _param(rngs, (c.d_ff, c.d_model), ("mlp", "embed"), c.d_model, c.param_dtype)
        self.up_proj = _param(rngs, (c.d_ff, c.d_model), ("mlp", "embed"), c.d_model, c.param_dtype)
        self.down_proj = _param(rngs, (c.d_model, c.d_ff), ("embed", "mlp"), c.d_ff, c.param_dtype)

    def __call__(self, x, decode: bool = False):
        dt = _dtype(self.dtype)
        b, t, d = x.shape
        x2 = x.astype(dt).reshape(b * t, d)
        gate = _linear(x2, self.gate_proj[...], dt, decode)
        up = _linear(x2, self.up_proj[...], dt, decode)
        return _linear(_swiglu(gate, up), self.down_proj[...], dt, decode).reshape(b, t, d)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.attention = Attention(config, rngs)
        self.post_attention_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, sin, cos, mask, layer_cache, cache_index, query_slots: tuple[int, int] | None = None,
                 decode: bool = False):
        """`query_slots` (start, stop): the output is only slots start..stop-1 (see Attention)."""
        attended, layer_cache = self.attention(self.input_norm(x), sin, cos, mask, layer_cache, cache_index,
                                               query_slots, decode)
        if query_slots is not None:
            x = x[:, query_slots[0]:query_slots[1]]
        x = x + attended.astype(x.dtype)
        x = x + self.mlp(self.post_attention_norm(x), decode).astype(x.dtype)
        return x, layer_cache


class Transformer(nnx.Module):
    """Token ids in, float32 logits out. See the module docstring for the masking contract."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.config = config
        # Embedding std 0.02-ish via fan_in d_model keeps tied logits at a sane scale at init.
        self.embed = _param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"), c.d_model, c.param_dtype)
        self.layers = nnx.List([DecoderLayer(c, rngs) for _ in range(c.n_layers)])
        self.final_norm = RMSNorm(c.d_model, c.norm_eps, c.param_dtype)
        if not c.tie_embeddings:
            self.lm_head = _param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"), c.d_model, c.param_dtype)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32 rotary positions
        kv_mask: jax.Array,  # [B, S] bool: slots holding real tokens (S = T without a cache)
        cache: Cache | None = None,
        cache_index: jax.Array | int = 0,  # slot of tokens[:, 0] in the cache
        output_slots: tuple[int, int] | None = None,
        remat: str = "none",
        hidden_only: bool = False,
    ) -> tuple[jax.Array, Cache | None]:
        """Logits [B, T, V]; with `output_slots` (start, stop) — static ints — only those of slots
        start..stop-1, [B, stop-start, V]. Every layer but the last still runs on all T slots (later
        slots attend to them, and a cache gets all T keys and values); the last computes queries, MLP,
        norm and head for the output slots alone. Same values as slicing the full logits, less work:
        training scores only the completion's slots, and a prefill samples from the last slot alone.

        `remat` "full" (training, no cache): each layer is rematerialised, so its backward pass
        recomputes the layer from its input instead of keeping its activations. `hidden_only`: the
        final-normed hidden states [B, T, D] instead of logits, for callers that apply the head in
        vocabulary chunks (`head_rows`)."""
        c = self.config
        t = tokens.shape[1]
        s = kv_mask.shape[1]
        if output_slots is not None:
            start, stop = output_slots
            if not 0 <= start < stop <= t:
                raise ValueError(f"output_slots {output_slots} must satisfy 0 <= start < stop <= {t} (the new slots)")
        slots = cache_index + jnp.arange(t)  # cache slot of each query
        causal = jnp.arange(s)[None, :] <= slots[:, None]  # [T, S]
        mask = kv_mask[:, None, :] & causal[None, :, :]  # [B, T, S]
        # Tabulated over max_seq_len positions for a full forward (many rotary applications share
        # them); computed directly for a cached step, whose few positions need no table.
        sin, cos = rope_angles(positions, c.head_dim, c.rope_theta, c.max_seq_len if cache is None else None)

        x = jnp.take(self.embed[...], tokens, axis=0).astype(_dtype(c.dtype))  # [B, T, D]
        decode = cache is not None and t == 1  # a one-token step: every matmul takes its decode form
        new_cache: Cache | None = [] if cache is not None else None
        if remat not in ("none", "full"):
            raise ValueError(f"remat must be 'none' or 'full', got {remat!r}")
        if remat != "none" and cache is not None:
            raise ValueError("remat applies to a full forward without a KV cache (training)")
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1
            query_slots = output_slots if last else None
            if remat == "none":
                x, layer_cache = layer(x, sin, cos, mask, None if cache is None else cache[i], cache_index,
                                       query_slots, decode)
            else:
                x, layer_cache = _remat_layer(layer, x, sin, cos, mask, query_slots)
            if new_cache is not None:
                new_cache.append(layer_cache)
        x = self.final_norm(x)
        if hidden_only:
            return x, new_cache
        b, t, d = x.shape
        logits = _linear(x.reshape(b * t, d), self.head_rows(), x.dtype, decode).reshape(b, t, -1)
        return logits.astype(jnp.float32), new_cache


    def head_rows(self) -> jax.Array:
        """The output projection as [V, D] rows (the embedding when tied): logits = hidden @ rows.T."""
        return self.embed[...] if self.config.tie_embeddings else self.lm_head[...]


@nnx.remat(static_argnums=(5,))
def _remat_layer(layer: DecoderLayer, x, sin, cos, mask, query_slots):
    # Nothing inside the layer is saved for the backward pass but its inputs (jax.checkpoint's default).
    return layer(x, sin, cos, mask, None, 0, query_slots)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> Cache:
    """An empty KV cache: per layer, keys zeros [B, K, Dh, max_len] and values [B, K, max_len, Dh]
    (see Attention for why the keys are transposed)."""
    dt = _dtype(dtype or config.dtype)
    keys = (batch, config.n_kv_heads, config.head_dim, max_len)
    values = (batch, config.n_kv_heads, max_len, config.head_dim)
    return [(jnp.zeros(keys, dt), jnp.zeros(values, dt)) for _ in range(config.n_layers)]


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Rotary positions of a left-padded batch: 0 at each row's first real token. mask: [B, T] bool."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def create_model(config: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(config, rngs=nnx.Rngs(params=seed))


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens, positions, kv_mask, cache=None, cache_index=0,
            output_slots: tuple[int, int] | None = None, remat: str = "none", hidden_only: bool = False):
    """Pure functional forward over split NNX state, for use inside `jax.jit` (cheap per call,
    unlike `nnx.jit`; PITFALLS.md). `output_slots`, `remat`, `hidden_only`: see `Transformer.__call__`."""
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, kv_mask, cache, cache_index, output_slots, remat, hidden_only)
