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

The decoder layers are stored as ONE `DecoderLayer` whose every parameter carries a leading
`layers` axis [L, ...] (MaxText's layout). The forward runs them either under `jax.lax.scan` over
that axis, so XLA compiles one layer body instead of L, or unrolled over static slices
(`ModelConfig.scan_layers`); the parameters, and so checkpoints, Hugging Face files and optimizer
state, are the same either way. Only the KV cache takes the form its path reads best (`Cache`).

Shapes: B batch, T new tokens this call, S cache slots, D d_model, H heads, K kv heads,
G = H/K query heads per kv head, Dh head_dim, F d_ff, V vocab, L layers.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from locojax.model.config import LoRAConfig, ModelConfig, lora_projection_dims
from locojax.model.sharding import state_shardings

LAYER_AXIS = "layers"  # the logical name of the stacked parameters' leading axis

# What a rematerialised layer keeps for the backward pass, by `remat` name (None: no remat).
# "full": nothing but the layer's input. "dots" (MaxText's "minimal"): also the outputs of the layer's
# weight matmuls (projections and MLP, whose dot_generals have no batch dimension), so the backward
# recomputes only norms, rotary, attention and activations, not the forward's matmul FLOPs.
REMAT_POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}

_MASKED = -1e30  # finite so a fully masked row (a pad query) gives a uniform softmax, not NaN


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def _scaled_normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """Standard normal float32 draws times fan_in^-1/2, bit for bit the same eager or compiled."""
    normal = jax.random.normal(rngs.params(), shape, jnp.float32)
    if isinstance(normal, jax.core.Tracer):
        # Inside one compiled initialisation (`create_model` on XLA:CPU) XLA would fold the scale into the
        # normal's own constant factor, which rounds differently from drawing then scaling: 1 ulp apart in
        # ~60% of a weight whose scale is not a power of two. The barrier keeps the eager draw's bits.
        normal = jax.lax.optimization_barrier(normal)
    return normal * (fan_in**-0.5)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], fan_in: int, dtype: str) -> nnx.Param:
    return nnx.Param(_scaled_normal(rngs, shape, fan_in).astype(_dtype(dtype)), axes=axes)


class LoRAParam(nnx.Variable):
    """A low-rank adapter matrix (LoRA's A [r, in] or B [out, r]). Its own variable type, not an
    nnx.Param, so filters tell adapters from the frozen weights: `nnx.state(model, LoRAParam)`,
    `split_adapters`."""


# Attention's targets; the rest (gate, up, down) are the MLP's.
_ATTENTION_TARGETS = ("q", "k", "v", "o")


def _add_adapters(layers: "DecoderLayer", config: ModelConfig, lora: LoRAConfig, rngs: nnx.Rngs) -> None:
    """Give the stacked decoder `layers` an adapter per target: A ~ N(0, 1/in) and B = 0, so the low-rank
    path adds exactly zero at first and the adapted model starts as the base model (bit for bit). Drawn
    layer by layer, target by target (as L separate layers would draw them), then stacked [L, ...].
    Adapters stay float32 whatever param_dtype is: they are small, and their optimizer updates need the
    range."""
    dims = lora_projection_dims(config)
    drawn: dict[str, list[jax.Array]] = {target: [] for target in lora.targets}
    for _ in range(config.n_layers):
        for target in lora.targets:
            fan_in = dims[target][0]
            drawn[target].append(_scaled_normal(rngs, (lora.rank, fan_in), fan_in))
    for target in lora.targets:
        fan_out = dims[target][1]
        module = layers.attention if target in _ATTENTION_TARGETS else layers.mlp
        setattr(module, f"{target}_lora_a", LoRAParam(jnp.stack(drawn.pop(target)),
                                                      axes=(LAYER_AXIS, "lora_rank", "lora_in")))
        setattr(module, f"{target}_lora_b", LoRAParam(jnp.zeros((config.n_layers, fan_out, lora.rank), jnp.float32),
                                                      axes=(LAYER_AXIS, "lora_out", "lora_rank")))


def _project(module: nnx.Module, target: str, x2: jax.Array, weight: jax.Array, dt, scale: float,
             decode: bool = False) -> jax.Array:
    """`_linear(x2, weight)` plus, when `module` holds an adapter for `target`, its low-rank path
    scale * (x2 A^T) B^T. The adapter is applied beside the frozen projection on every call (training,
    prefill and each decode step alike), never merged into the weight here: a merge would rewrite every
    adapted [out, in] weight at each call, where the side path costs rank * (in + out) per row. A
    rollout may fold them in once for all its decode steps instead (`fold_adapters_for_rollout`)."""
    out = _linear(x2, weight, dt, decode)
    a = getattr(module, f"{target}_lora_a", None)
    if a is None:
        return out
    b = getattr(module, f"{target}_lora_b")
    low = (x2 @ a[...].astype(dt).T) * jnp.asarray(scale, dt)  # [N, r]
    return out + low @ b[...].astype(dt).T


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


@flax.struct.dataclass
class Cache:
    """The KV cache of every layer; the one place that knows its layout, how new tokens are written
    into it and how attention reads it. Per layer:

        keys   [B, K, Dh, S]
        values [B, K, S, Dh]

    Both attention products are dot_generals with the few query rows (Tq x G) on the left:
    q [G, Dh] @ keys [Dh, S], then probs [G, S] @ values [S, Dh], each reading its cache in place
    with the slots as the long, contiguous axis. Keys slot-major like the values made XLA:CPU run the
    scores 2x slower (a batched dot with the cache on the left), and the same products as einsums
    let it put the cache on the left and contract over its second-minor axis, 4x slower still. At
    0.6B and 16 rows this cut the decode step's attention from ~55 to ~35 ms (bench/scale.py).

    The layers are held in one of two forms, matching how the forward runs them:
      * stacked (scanned layers): `keys` [L, B, K, Dh, S] and `values` [L, B, K, S, Dh], carried
        through the layer scan; a layer reads its slice by a traced index.
      * per layer (unrolled layers): `keys` and `values` are tuples of L arrays. XLA:CPU copies a
        slice of a stacked array before a matmul reads it, which would copy the whole cache every
        decode step; separate arrays are read where they lie.
    Either way a write touches only the new tokens' slots of one layer (`dynamic_update_slice`), so
    the decode loop (and the layer scan) update the buffers in place.

    `window` (static): attention reads slots [0, window) only, where the caller knows no later slot
    is filled yet (a decode segment, `locojax.rollout`); None reads every slot. Shapes are static, so
    without it every decode step reads the whole cache, the slots still empty included: at Qwen3-0.6B,
    128 rows, 64 + 128 tokens, the two attention products read the cache at the chip's bandwidth and
    were ~half the decode step (the profile in bench/results/scale_tpu.json at 57f5857)."""

    keys: jax.Array | tuple[jax.Array, ...]
    values: jax.Array | tuple[jax.Array, ...]
    window: int | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, config: ModelConfig, batch: int, max_len: int, dtype: str | None = None, *,
               stacked: bool) -> "Cache":
        """An empty cache of `max_len` slots (zeros; the caller's kv_mask says which slots are real)."""
        dt = _dtype(dtype or config.dtype)
        keys = (batch, config.n_kv_heads, config.head_dim, max_len)
        values = (batch, config.n_kv_heads, max_len, config.head_dim)
        if stacked:
            return cls(keys=jnp.zeros((config.n_layers, *keys), dt), values=jnp.zeros((config.n_layers, *values), dt))
        return cls(keys=tuple(jnp.zeros(keys, dt) for _ in range(config.n_layers)),
                   values=tuple(jnp.zeros(values, dt) for _ in range(config.n_layers)))

    @property
    def stacked(self) -> bool:
        return not isinstance(self.keys, tuple)

    def write(self, layer, keys: jax.Array, values: jax.Array, index) -> "Cache":
        """`keys`, `values` [B, T, K, Dh] into slots index..index+T-1 of `layer`."""
        keys = keys.transpose(0, 2, 3, 1)  # [B, K, Dh, T]
        values = values.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
        if self.stacked:
            return self.replace(
                keys=jax.lax.dynamic_update_slice(self.keys, keys[None].astype(self.keys.dtype),
                                                  (layer, 0, 0, 0, index)),
                values=jax.lax.dynamic_update_slice(self.values, values[None].astype(self.values.dtype),
                                                    (layer, 0, 0, index, 0)))
        old_keys, old_values = self.keys[layer], self.values[layer]
        new_keys = jax.lax.dynamic_update_slice(old_keys, keys.astype(old_keys.dtype), (0, 0, 0, index))
        new_values = jax.lax.dynamic_update_slice(old_values, values.astype(old_values.dtype), (0, 0, index, 0))
        return self.replace(keys=(*self.keys[:layer], new_keys, *self.keys[layer + 1:]),
                            values=(*self.values[:layer], new_values, *self.values[layer + 1:]))

    def scores(self, layer, query_rows: jax.Array) -> jax.Array:
        """`query_rows` [B, K, R, Dh] against the slots of `layer` in the window: [B, K, R, window or S]."""
        keys = _layer_window(self.keys, layer, self.window, slot_axis=3).astype(query_rows.dtype)
        return jax.lax.dot_general(query_rows, keys, (((3,), (2,)), ((0, 1), (0, 1))))

    def mix(self, layer, prob_rows: jax.Array) -> jax.Array:
        """Attention weights `prob_rows` [B, K, R, window or S] over `layer`'s values: [B, K, R, Dh]."""
        values = _layer_window(self.values, layer, self.window, slot_axis=2).astype(prob_rows.dtype)
        return jax.lax.dot_general(prob_rows, values, (((3,), (2,)), ((0, 1), (0, 1))))

    def windowed(self, window: int | None) -> "Cache":
        """The same buffers, attention reading slots [0, window) only (None: all of them)."""
        slots = self.values.shape[-2] if self.stacked else self.values[0].shape[-2]
        if window is not None and not 0 < window <= slots:
            raise ValueError(f"cache window {window} must be in 1..{slots} (the cache's slots)")
        return self.replace(window=window)

    def batch_sharded(self, batch_sharding: jax.sharding.NamedSharding) -> "Cache":
        """Constrained to `batch_sharding` (a batch-first array's) on its batch axis, the layer axis whole."""
        spec = (None, *batch_sharding.spec) if self.stacked else tuple(batch_sharding.spec)
        sharding = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec(*spec))
        return jax.lax.with_sharding_constraint(self, sharding)


def _layer_window(arrays: jax.Array | tuple[jax.Array, ...], layer, window: int | None, slot_axis: int) -> jax.Array:
    """One layer's keys or values, slots [0, window) of its `slot_axis` (the layer's own axes).

    From a stacked cache, the layer and its window are ONE dynamic slice, the form XLA:TPU already
    read in place inside the attention's matmul fusion (the layer's slice); a static slice of the
    window after the layer's made the v5e's decode step 6% slower than reading every slot
    (bench/scale.py's limits, 8.40 vs 7.91 ms at Qwen3-0.6B bf16, 128 rows), as a copy would."""
    if isinstance(arrays, tuple):
        layer_array = arrays[layer]
        return layer_array if window is None else jax.lax.slice_in_dim(layer_array, 0, window, axis=slot_axis)
    sizes = list(arrays.shape)
    sizes[0] = 1
    if window is not None:
        sizes[slot_axis + 1] = window
    start = (layer,) + (0,) * (arrays.ndim - 1)
    return jax.lax.dynamic_slice(arrays, start, sizes)[0]


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

    def __call__(self, x, sin, cos, mask, cache: Cache | None, layer, cache_index,
                 query_slots: tuple[int, int] | None = None, decode: bool = False):
        """`cache`: every layer's, of which this is layer `layer`; returned with this call's keys and
        values written at slots cache_index.. .
        `query_slots` (start, stop): keys and values of all T slots (written to the cache when there
        is one), but queries (and so the output, [B, stop-start, D]) only for slots start..stop-1;
        `mask` is still [B, T, S].
        `decode`: this is a one-token step on a cache (the caller decides it once for every layer)."""
        c = self.config
        dt = _dtype(c.dtype)
        b, t = x.shape[:2]
        scale = c.lora.scale if c.lora else 0.0
        x2 = x.astype(dt).reshape(b * t, c.d_model)
        k = _project(self, "k", x2, self.k_proj[...].reshape(-1, c.d_model), dt, scale, decode)
        v = _project(self, "v", x2, self.v_proj[...].reshape(-1, c.d_model), dt, scale, decode)
        if query_slots is None:
            q = _project(self, "q", x2, self.q_proj[...].reshape(-1, c.d_model), dt, scale, decode)
            sin_q, cos_q = sin, cos
        else:
            start, stop = query_slots
            q_rows = x[:, start:stop].astype(dt).reshape(-1, c.d_model)
            q = _project(self, "q", q_rows, self.q_proj[...].reshape(-1, c.d_model), dt, scale)
            sin_q, cos_q, mask = sin[:, start:stop], cos[:, start:stop], mask[:, start:stop]
        tq = q.shape[0] // b
        q = q.reshape(b, tq, c.n_heads, c.head_dim)  # [B, Tq, H, Dh]
        k = k.reshape(b, t, c.n_kv_heads, c.head_dim)  # [B, T, K, Dh]
        v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, sin_q, cos_q), apply_rope(k, sin, cos)

        q = q.reshape(b, tq, c.n_kv_heads, c.q_per_kv, c.head_dim)  # [B, Tq, K, G, Dh]
        if cache is None:
            k = k.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
            scores = jnp.einsum("btkgh,bksh->bkgts", q, k)
        else:
            cache = cache.write(layer, k, v, cache_index)
            q_rows = q.transpose(0, 2, 1, 3, 4).reshape(b, c.n_kv_heads, tq * c.q_per_kv, c.head_dim)
            scores = cache.scores(layer, q_rows)  # [B, K, Tq*G, S]
            scores = scores.reshape(b, c.n_kv_heads, tq, c.q_per_kv, -1).transpose(0, 1, 3, 2, 4)
        scores = scores.astype(jnp.float32) * (c.head_dim**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        if cache is None:
            v = v.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
            out = jnp.einsum("bkgts,bksh->btkgh", probs, v.astype(dt)).reshape(b * tq, c.n_heads * c.head_dim)
        else:
            p_rows = probs.transpose(0, 1, 3, 2, 4).reshape(b, c.n_kv_heads, tq * c.q_per_kv, -1)
            out = cache.mix(layer, p_rows)  # [B, K, Tq*G, Dh]
            out = out.reshape(b, c.n_kv_heads, tq, c.q_per_kv, c.head_dim).transpose(0, 2, 1, 3, 4)
            out = out.reshape(b * tq, c.n_heads * c.head_dim)
        o_proj = self.o_proj[...].reshape(c.d_model, c.n_heads * c.head_dim)
        return _project(self, "o", out, o_proj, dt, scale, decode).reshape(b, tq, c.d_model), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), on [B*T, D] for the reason `_project` gives."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.dtype = c.dtype
        self.lora_scale = c.lora.scale if c.lora else 0.0
        self.gate_proj = _param(rngs, (c.d_ff, c.d_model), ("mlp", "embed"), c.d_model, c.param_dtype)
        self.up_proj = _param(rngs, (c.d_ff, c.d_model), ("mlp", "embed"), c.d_model, c.param_dtype)
        self.down_proj = _param(rngs, (c.d_model, c.d_ff), ("embed", "mlp"), c.d_ff, c.param_dtype)

    def __call__(self, x, decode: bool = False):
        dt = _dtype(self.dtype)
        b, t, d = x.shape
        x2 = x.astype(dt).reshape(b * t, d)
        scale = self.lora_scale
        gate = _project(self, "gate", x2, self.gate_proj[...], dt, scale, decode)
        up = _project(self, "up", x2, self.up_proj[...], dt, scale, decode)
        return _project(self, "down", _swiglu(gate, up), self.down_proj[...], dt, scale, decode).reshape(b, t, d)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.attention = Attention(config, rngs)
        self.post_attention_norm = RMSNorm(config.d_model, config.norm_eps, config.param_dtype)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, sin, cos, mask, cache: Cache | None, layer, cache_index,
                 query_slots: tuple[int, int] | None = None, decode: bool = False):
        """Layer number `layer` (its index into `cache`). `query_slots` (start, stop): the output is
        only slots start..stop-1 (see Attention)."""
        attended, cache = self.attention(self.input_norm(x), sin, cos, mask, cache, layer, cache_index,
                                         query_slots, decode)
        if query_slots is not None:
            x = x[:, query_slots[0]:query_slots[1]]
        x = x + attended.astype(x.dtype)
        x = x + self.mlp(self.post_attention_norm(x), decode).astype(x.dtype)
        return x, cache


# A scanned stack ([L, ...] leaves) or one state per layer (`Transformer.layer_params`).
LayerParams = nnx.State | tuple[nnx.State, ...]


class Transformer(nnx.Module):
    """Token ids in, float32 logits out. See the module docstring for the masking contract."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.config = config
        # Embedding std 0.02-ish via fan_in d_model keeps tied logits at a sane scale at init.
        self.embed = _param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"), c.d_model, c.param_dtype)
        self.layers = _build_layers(c, rngs)
        self.final_norm = RMSNorm(c.d_model, c.norm_eps, c.param_dtype)
        if not c.tie_embeddings:
            self.lm_head = _param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"), c.d_model, c.param_dtype)
        if c.lora is not None:  # drawn after every base weight, so the base is the same with or without LoRA
            _add_adapters(self.layers, c, c.lora, rngs)

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
        layers: LayerParams | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """Logits [B, T, V]; with `output_slots` (start, stop) — static ints — only those of slots
        start..stop-1, [B, stop-start, V]. Every layer but the last still runs on all T slots (later
        slots attend to them, and a cache gets all T keys and values); the last computes queries, MLP,
        norm and head for the output slots alone. Same values as slicing the full logits, less work:
        training scores only the completion's slots, and a prefill samples from the last slot alone.

        `remat` (training, no cache): "full" rematerialises each layer, so its backward pass
        recomputes the layer from its input instead of keeping its activations; "dots" keeps the
        layer's weight-matmul outputs and recomputes the rest (`REMAT_POLICIES`).
        `hidden_only`: the final-normed hidden states [B, T, D] instead of logits, for callers that
        apply the head in vocabulary chunks (`head_rows`). `layers`: this model's `layer_params()`,
        prepared once outside a loop that calls the model many times (default: prepared here)."""
        c = self.config
        t = tokens.shape[1]
        s = kv_mask.shape[1]
        if output_slots is not None:
            start, stop = output_slots
            if not 0 <= start < stop <= t:
                raise ValueError(f"output_slots {output_slots} must satisfy 0 <= start < stop <= {t} (the new slots)")
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")
        if remat != "none" and cache is not None:
            raise ValueError("remat applies to a full forward without a KV cache (training)")
        if cache is not None and cache.window is not None:
            s = cache.window  # attention reads these slots alone (the later ones hold nothing yet)
            kv_mask = kv_mask[:, :s]
        slots = cache_index + jnp.arange(t)  # cache slot of each query
        causal = jnp.arange(s)[None, :] <= slots[:, None]  # [T, S]
        mask = kv_mask[:, None, :] & causal[None, :, :]  # [B, T, S]
        # Tabulated over max_seq_len positions for a full forward (many rotary applications share
        # them); computed directly for a cached step, whose few positions need no table.
        sin, cos = rope_angles(positions, c.head_dim, c.rope_theta, c.max_seq_len if cache is None else None)

        x = jnp.take(self.embed[...], tokens, axis=0).astype(_dtype(c.dtype))  # [B, T, D]
        decode = cache is not None and t == 1  # a one-token step: every matmul takes its decode form
        layer_graph = nnx.graphdef(self.layers)

        def apply_layer(params, x, cache, layer, query_slots):
            return nnx.merge(layer_graph, params)(x, sin, cos, mask, cache, layer, cache_index, query_slots, decode)

        layers = self.layer_params() if layers is None else layers
        x, cache = _run_layers(apply_layer, layers, x, cache, output_slots, REMAT_POLICIES[remat])
        x = self.final_norm(x)
        if hidden_only:
            return x, cache
        b, t, d = x.shape
        logits = _linear(x.reshape(b * t, d), self.head_rows(), x.dtype, decode).reshape(b, t, -1)
        return logits.astype(jnp.float32), cache

    def layer_params(self) -> LayerParams:
        """The decoder layers' parameters in the form the forward runs them (`ModelConfig.scan_layers`
        on this platform): the stacked state itself ([L, ...] leaves) for a scan, one state per layer
        for unrolled layers. On XLA:CPU each of those slices is a copy of the layer's weights, so a
        loop that runs the model many times (decode) prepares them once, outside it (`forward`'s
        `layers`)."""
        stacked = nnx.state(self.layers)
        if self.config.scans_layers(jax.default_backend()):
            return stacked
        return tuple(jax.tree.map(lambda p: p.reshape(p.shape[1:]), layer)
                     for layer in _split_layers(stacked, [1] * self.config.n_layers))

    def head_rows(self) -> jax.Array:
        """The output projection as [V, D] rows (the embedding when tied): logits = hidden @ rows.T."""
        return self.embed[...] if self.config.tie_embeddings else self.lm_head[...]


# Platforms where the decoder's weights are built in place (`_build_layers`): everywhere but XLA:CPU,
# whose "device" memory is the host's and where each process would pay for compiling the writes.
BUILD_LAYERS_IN_PLACE: dict[str, bool] = {"cpu": False}


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stacked: list[jax.Array], layer: list[jax.Array], index: jax.Array) -> list[jax.Array]:
    """`stacked` (donated: updated in place) with `layer`'s weights at `index` of their leading axis."""
    return [jax.lax.dynamic_update_index_in_dim(s, x, index, 0) for s, x in zip(stacked, layer)]


def _build_layers(config: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """The decoder: L layers drawn one after the other (the values of L separate DecoderLayers), held
    stacked on a leading `layers` axis.

    On accelerators each layer is written into the stacked weights in place and dropped before the next
    is drawn, so building the model peaks at the model plus one layer. Stacking L finished layers
    (`_stack_layers`, kept for XLA:CPU) peaks at the model plus its largest stacked weight: on a v5e
    that was the device's highest use of the whole run with LoRA, whose optimizer state is too small
    to hide it (Qwen3-1.7B: 3.94 GiB while building, 3.47 GiB from the first step on;
    bench/results/tpu_memory_timeline_tpu.json)."""
    if not BUILD_LAYERS_IN_PLACE.get(jax.default_backend(), True):
        return _stack_layers([DecoderLayer(config, rngs) for _ in range(config.n_layers)])
    first = DecoderLayer(config, rngs)  # also the template of every stacked variable's metadata
    templates, treedef = jax.tree.flatten(nnx.state(first), is_leaf=_is_variable)
    stacked = [jnp.zeros((config.n_layers, *v.shape), v.dtype) for v in templates]
    stacked = _write_layer(stacked, [v[...] for v in templates], jnp.int32(0))
    for index in range(1, config.n_layers):
        layer = jax.tree.leaves(nnx.state(DecoderLayer(config, rngs)), is_leaf=_is_variable)
        stacked = _write_layer(stacked, [v[...] for v in layer], jnp.int32(index))
        del layer  # before the next layer is drawn
    leaves = [t.replace(value, axes=(LAYER_AXIS, *t.get_metadata()["axes"])) for t, value in zip(templates, stacked)]
    return nnx.merge(nnx.graphdef(first), jax.tree.unflatten(treedef, leaves))


def _stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One DecoderLayer holding `layers`' parameters stacked on a leading `layers` axis."""

    def stack(*variables: nnx.Variable) -> nnx.Variable:
        axes = variables[0].get_metadata()["axes"]
        stacked = variables[0].replace(jnp.stack([v[...] for v in variables]), axes=(LAYER_AXIS, *axes))
        # Each layer's copy goes as soon as its weight is stacked, not after the whole decoder is: building
        # a model then peaks at the model plus one stacked weight, not twice the decoder (on a TPU that was
        # ~2.5 GiB above the run's memory plan at Qwen3-1.7B, before the first step).
        for variable in variables:
            variable.set_value(None)
        return stacked

    states = [nnx.state(layer) for layer in layers]
    stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(nnx.graphdef(layers[0]), stacked)


def _split_layers(stacked: nnx.State, sizes: list[int]) -> list[nnx.State]:
    """`stacked` cut along its layer axis into pieces of `sizes` layers (each still stacked).
    `lax.split`, not an index per layer: its gradient is one concatenation, not L zero-padded
    full-size arrays summed."""
    leaves, treedef = jax.tree.flatten(stacked)
    pieces = [jax.lax.split(leaf, sizes) for leaf in leaves]
    return [jax.tree.unflatten(treedef, [piece[i] for piece in pieces]) for i in range(len(sizes))]


def _run_layers(apply_layer, layers: LayerParams, x, cache: Cache | None, output_slots, remat_policy):
    """x through every layer in turn: `apply_layer(params, x, cache, layer, query_slots) -> (x, cache)`
    with one layer's `params`. With `output_slots` the last layer runs on those slots alone (see
    `Transformer.__call__`).

    A stacked `layers` runs the layers as one `lax.scan` over its leading axis (XLA compiles one
    layer body), carrying x and the (stacked) cache; with `output_slots` the slots are cut after the
    scan (the last layer runs on all of them: see the comment below). A tuple runs them as a Python loop. `remat_policy`
    (`REMAT_POLICIES`): each layer is `jax.checkpoint`ed with it."""
    unrolled = isinstance(layers, tuple)
    if remat_policy is not None:
        apply_layer = jax.checkpoint(apply_layer, policy=remat_policy, static_argnums=(4,),
                                     prevent_cse=unrolled)  # inside a scan, CSE cannot undo the remat
    if unrolled:
        for layer, params in enumerate(layers):
            x, cache = apply_layer(params, x, cache, layer, output_slots if layer == len(layers) - 1 else None)
        return x, cache
    if cache is not None and not cache.stacked:
        raise ValueError("scanned layers need a stacked cache: build it with init_cache for the same config")
    count = jax.tree.leaves(layers)[0].shape[0]

    def body(carry, layer_and_params):
        layer, params = layer_and_params
        return apply_layer(params, *carry, layer, None), None

    # Every layer, the last included, runs in the scan over the stacked weights as they are: cutting
    # the last one off (`_split_layers`) made XLA materialise the other layers' weights as a second
    # copy, a temporary the size of the model (Qwen3-4B: 7 GiB, so LoRA did not fit one v5e at any
    # rows), and the gradient its concatenation. The last layer then computes all T slots and the
    # output slots are cut after it: 1/n_layers of the body's work on the slots not scored.
    (x, cache), _ = jax.lax.scan(body, (x, cache), (jnp.arange(count), layers))
    if output_slots is not None:
        x = x[:, output_slots[0]:output_slots[1]]
    return x, cache


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> Cache:
    """An empty KV cache for `batch` rows and `max_len` slots, in the form (`Cache`) the forward's way
    of running the layers on this platform needs."""
    return Cache.create(config, batch, max_len, dtype, stacked=config.scans_layers(jax.default_backend()))


def split_adapters(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(frozen weights, adapters) of a model's params; `nnx.merge_state` puts them back together."""
    frozen, adapters = nnx.split_state(params, nnx.Not(LoRAParam), LoRAParam)
    return frozen, adapters


def fold_adapters_for_rollout(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    """The model a rollout runs: with `LoRAConfig.rollout` "merged", the adapted weights with their
    adapters folded in (W + scale B A, summed in float32 and rounded once to the weight's dtype) and
    the graph without adapters, so each decode step runs one matmul per projection instead of three;
    otherwise `graphdef, params` unchanged. For use inside `jax.jit` (the rollout's program): the folded
    weights are that program's temporaries, one copy of the adapted weights, folded one layer at a
    time (`lax.map`) so the float32 products stay one layer's worth. Not the default: where decode is
    bound by reading the weights (a v5e at Qwen3-1.7B, 16 rows) it was no faster (README, LoRA)."""
    lora = nnx.merge(graphdef, params).config.lora
    if lora is None or lora.rollout != "merged":
        return graphdef, params
    model = nnx.merge(graphdef, params, copy=True)  # its own variables: the caller's state stays as it is
    for target in lora.targets:
        module = model.layers.attention if target in _ATTENTION_TARGETS else model.layers.mlp
        a = getattr(module, f"{target}_lora_a")[...]  # [L, r, in]
        b = getattr(module, f"{target}_lora_b")[...]  # [L, out, r]
        weight = getattr(module, f"{target}_proj")  # [L, ...] whose trailing dims flatten to [out, in]

        def fold(layer, scale=lora.scale):
            w, a_layer, b_layer = layer
            delta = jnp.matmul(b_layer, a_layer, precision=jax.lax.Precision.HIGHEST) * scale
            return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)

        weight[...] = jax.lax.map(fold, (weight[...], a, b))
        delattr(module, f"{target}_lora_a")
        delattr(module, f"{target}_lora_b")
    return nnx.split(model)


def adapters_off(adapters: nnx.State) -> nnx.State:
    """Zero adapters of the same structure: the base model's output (B = 0 adds exactly nothing). The
    KL reference runs the frozen weights with these, so it costs adapter-sized zeros, not a second
    copy of the weights."""
    return jax.tree.map(jnp.zeros_like, adapters)


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Rotary positions of a left-padded batch: 0 at each row's first real token. mask: [B, T] bool."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def create_model(config: ModelConfig, seed: int = 0, mesh: Mesh | None = None) -> Transformer:
    """A model with weights drawn from `seed`, the same bits on every backend and every host.

    On XLA:CPU the whole draw is one compiled program. Drawn eagerly, each weight shape compiled its own
    small programs (a normal, a scale, a cast, a stack per stacked weight): ~20 compilations, 0.8 s of a
    tiny model's cold start in every process that builds one, and a test run starts hundreds. With
    `mesh`, that program also puts each weight where `shard_state` would on the mesh (every process of a
    job draws the same bits): placing process-local weights on a mesh across processes compiled one more
    program per weight shape (16 for the tiny model). On accelerators the decoder is drawn layer by layer
    and written in place (`_build_layers`; `mesh` is then left to `shard_state`), so the build's peak is
    the model plus one layer, as measured on a v5e; one program would leave that peak to XLA's scheduler."""
    if BUILD_LAYERS_IN_PLACE.get(jax.default_backend(), True) or not 0 <= seed < 2**31:
        return Transformer(config, rngs=nnx.Rngs(params=seed))
    seed_value = np.int32(seed)  # an argument, not a constant: one program serves every seed
    if mesh is None:
        return _create_in_one_program(config, seed_value)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _seeded_transformer(config, seed_value)))
    draw = jax.jit(lambda value: nnx.split(_seeded_transformer(config, value))[1],
                   out_shardings=state_shardings(abstract, mesh))
    return nnx.merge(graphdef, draw(seed_value))


def _seeded_transformer(config: ModelConfig, seed: jax.Array) -> Transformer:
    # jax.random.key of an int32 seed draws what nnx.Rngs(params=seed) of the Python int does.
    return Transformer(config, rngs=nnx.Rngs(params=jax.random.key(seed)))


@functools.partial(nnx.jit, static_argnums=0)
def _create_in_one_program(config: ModelConfig, seed: jax.Array) -> Transformer:
    return _seeded_transformer(config, seed)


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens, positions, kv_mask, cache=None, cache_index=0,
            output_slots: tuple[int, int] | None = None, remat: str = "none", hidden_only: bool = False,
            layers: LayerParams | None = None):
    """Pure functional forward over split NNX state, for use inside `jax.jit` (cheap per call,
    unlike `nnx.jit`; PITFALLS.md). `output_slots`, `remat`, `hidden_only`, `layers`: see
    `Transformer.__call__`."""
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, kv_mask, cache, cache_index, output_slots, remat, hidden_only, layers)


def layer_params(graphdef: nnx.GraphDef, params: nnx.State) -> LayerParams:
    """`Transformer.layer_params` over split NNX state (for `forward`'s `layers`)."""
    return nnx.merge(graphdef, params).layer_params()
