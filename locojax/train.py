"""Training: the optimizer, the one-pytree `TrainState`, and the jitted GRPO and SFT steps.

`make_train_step` / `make_sft_step` return pure functions `step(state, batch) -> (state, metrics)`,
jitted once with the state donated. Static configuration (algorithm, temperature, micro-batch
count) is closed over; nothing else about a step lives outside the state.

Batch layout (all arrays lead with the batch axis B; P prompt slots, N = max_new_tokens):
    tokens          int32   [B, P+N]  left-padded prompt, then the completion (padded after EOS)
    prompt_mask     bool    [B, P]    True on real prompt tokens (left padding is False)
    completion_mask bool    [B, N]    True on completion tokens, EOS included; False after it
    old_logprobs    float32 [B, N]    log-probs of the completion under the policy that sampled it
                                      (log_softmax(logits / temperature), as the sampler returns)
    ref_logprobs    float32 [B, N]    the frozen reference policy's log-probs; only if kl_coef > 0
    advantages      float32 [B]       one per sequence (locojax.algo.ADVANTAGES)
The SFT step reads only tokens, prompt_mask and completion_mask.

The model sees kv_mask = concat(prompt_mask, completion_mask) and rotary positions
cumsum(kv_mask) - 1, exactly as rollout fed them, and logits at slot i predict token i+1: the
log-prob of completion token j comes from the logits at slot P+j-1.

Data parallelism: pass `state` (params replicated, or sharded per the model's rules) and a batch
whose axis B is sharded over the mesh axis `data` (e.g. built with
`jax.make_array_from_process_local_data`). Losses are whole-batch weighted sums
(locojax.algo.losses), so micro-batching and sharding change nothing but float rounding.
Given the `mesh` of a purely data-parallel layout (params replicated), the step computes each
device's gradient sum under `shard_map` and reduces gradients and metrics as ONE flat buffer
(`packed_data_parallel_grads`). Left to itself, `jax.jit` all-reduces one tuple element per
parameter, and on CPU hosts joined by `jax.distributed` (gloo over TCP) every element costs
milliseconds of synchronisation however small it is: 27 elements took 108 ms where one 8 MiB buffer
took 9 ms, with two pinned processes on the 2-core development machine. With other layouts (fsdp or
tensor axes > 1) the step leaves the collectives to `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from locojax import metrics as m
from locojax.algo.losses import LOSS_AGGREGATIONS, POLICY_LOSSES, token_mean_weights
from locojax.model import positions_from_mask, split_adapters
from locojax.model.transformer import LoRAParam
from locojax.placement.memory import LOGPROB_VOCAB_CHUNK, num_micro_batches
from locojax.spec import AlgoSpec, OptimSpec

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
StepFn = Callable[["TrainState", Batch], tuple["TrainState", Metrics]]
# Passed to jax.jit; e.g. {"xla_backend_optimization_level": 0} halves CPU compile time in tests.
CompilerOptions = Mapping[str, Any] | None


@flax.struct.dataclass
class TrainState:
    """All training state, one pytree: checkpointed and donated to the step whole, except LoRA's
    `frozen` base weights, which the step reads beside it and a checkpoint leaves out."""

    step: jax.Array  # int32 []: train steps (batches) completed
    params: nnx.State  # the trained params: the whole model's, or with LoRA its adapters alone
    opt_state: optax.OptState  # over `params` only
    rng: jax.Array  # uint32 [2]: the run's PRNG key; the mode splits it for sampling, the step leaves it
    # With LoRA, the frozen base weights: read by the step, never updated, donated or checkpointed.
    frozen: nnx.State | None = None

    @property
    def model_params(self) -> nnx.State:
        """The model's whole param state (frozen weights and adapters together) for a forward pass."""
        return model_params(self.params, self.frozen)


def model_params(params: nnx.State, frozen: nnx.State | None) -> nnx.State:
    """`params` completed by the `frozen` weights (no copy), or `params` itself when nothing is frozen."""
    return params if frozen is None else nnx.merge_state(frozen, params)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The optax transformation plus the learning rate as a function of the *train step*."""

    tx: optax.GradientTransformation
    lr_schedule: Callable[[jax.Array | int], jax.Array]
    updates_per_step: int = 1


def lr_schedule(optim: OptimSpec, total_steps: int) -> Callable[[jax.Array | int], jax.Array]:
    """Learning rate at train step s: linear warmup lr*(s+1)/warmup_steps for s < warmup_steps (the
    first update already moves the weights), then constant, or cosine from lr to 0 at total_steps."""
    peak, warmup = float(optim.lr), int(optim.warmup_steps)
    decay_steps = max(1, int(total_steps) - warmup)
    cosine = optim.decay == "cosine"

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (step + 1.0) / warmup) if warmup > 0 else jnp.float32(1.0)
        if not cosine:
            return peak * warm
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        return peak * warm * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))

    return schedule


def make_optimizer(optim: OptimSpec, total_steps: int, updates_per_step: int = 1) -> Optimizer:
    """AdamW after global-norm clipping. `updates_per_step` (AlgoSpec.num_iterations) updates share one
    train step's learning rate, so warmup and decay are counted in train steps, as the spec says.
    Weight decay applies to matrices only (norm scales are left alone)."""
    train_schedule = lr_schedule(optim, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(optim.grad_clip),
        optax.adamw(
            learning_rate=lambda count: train_schedule(count // updates_per_step),
            b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay,
            mask=decays,
        ),
    )
    return Optimizer(tx=tx, lr_schedule=train_schedule, updates_per_step=updates_per_step)


def decays(params):
    """Which leaves weight decay applies to: matrices, judged per layer. The decoder layers' parameters
    (`Transformer.layers`) are stacked on a leading layer axis, so there a norm scale is [L, D] and a
    matrix has three or more axes; elsewhere (embedding, final norm) a matrix has two."""
    def is_matrix(path, leaf) -> bool:
        first = getattr(path[0], "key", None) if path else None
        return leaf.ndim >= (3 if first == "layers" else 2)
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of a model whose only state is nnx.Param and LoRA adapters (true of
    locojax.model); with adapters, `split_adapters(params)` tells them from the frozen weights."""
    graphdef, params, rest = nnx.split(model, (nnx.Param, LoRAParam), ...)
    if jax.tree.leaves(rest):
        raise ValueError("the model holds non-Param state; TrainState.params would not capture it")
    return graphdef, params


def init_train_state(params: nnx.State, optimizer: Optimizer, seed: int | jax.Array = 0, *,
                     lora: bool = False) -> TrainState:
    """A fresh state at step 0. `seed` is an int or an existing uint32[2] key. `lora`: train the
    adapters of `params` alone; the rest becomes the state's `frozen` weights, with no gradient and
    no optimizer state."""
    rng = jax.random.PRNGKey(seed) if isinstance(seed, int) else jnp.asarray(seed)
    frozen = None
    if lora:
        frozen, params = split_adapters(params)
        if not jax.tree.leaves(params):
            raise ValueError("lora=True but the model holds no adapters (ModelConfig.lora is None)")
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=fresh_optimizer_state(optimizer.tx, params),
                      rng=rng, frozen=frozen)


def fresh_optimizer_state(tx: optax.GradientTransformation, params: nnx.State) -> optax.OptState:
    """`tx.init(params)` as one compiled program, each params-shaped leaf placed as its parameter is and
    the rest (step counts) replicated over the same devices: run eagerly, every leaf shape compiled its
    own zeros (10 programs for the tiny model, in each process that starts a run)."""
    shardings = [getattr(leaf, "sharding", None) for leaf in jax.tree.leaves(params)]
    if not shardings or None in shardings:  # host arrays: nothing to place by
        return tx.init(params)
    whole = (NamedSharding(shardings[0].mesh, PartitionSpec()) if isinstance(shardings[0], NamedSharding)
             else shardings[0])
    placed = optimizer_state_shardings(tx, jax.eval_shape(tx.init, params),
                                       jax.tree.map(lambda leaf: leaf.sharding, params), whole)
    return jax.jit(tx.init, out_shardings=placed)(params)


def optimizer_state_shardings(tx: optax.GradientTransformation, opt_state, param_shardings, replicated):
    """`opt_state`'s shardings: each params-shaped part as `param_shardings`, the rest `replicated`."""
    return optax.tree_map_params(tx, lambda _, sharding: sharding, opt_state, param_shardings,
                                 transform_non_params=lambda _: replicated)


class _StateKeepingJit:
    """`jax.jit(fn, donate_argnums=0)` for `fn(state, *rest) -> (new_state, *outputs)`, whose new state is
    laid out as the state it was given (`out_shardings`, fixed by the first call or `.lower`): left to
    itself, XLA may shard an output its input had replicated (LoRA's A matrices under FSDP came back
    sharded over `fsdp`), so the next step met a state of another layout and compiled again, and so did
    every program reading the params."""

    def __init__(self, fn: Callable, compiler_options: CompilerOptions):
        self.fn, self.compiler_options = fn, compiler_options
        self.jitted = None

    def _for(self, state):
        if self.jitted is None:
            # Placed leaves keep their sharding; an uncommitted one (a fresh step counter on the default
            # device) is left to XLA (None), as jit moves such inputs wherever the program needs them.
            layout = jax.tree.map(lambda x: x.sharding if getattr(x, "committed", True) else None, state)
            self.jitted = jax.jit(self.fn, donate_argnums=0, compiler_options=self.compiler_options,
                                  out_shardings=(layout, None))
        return self.jitted

    def __call__(self, state, *rest):
        return self._for(state)(state, *rest)

    def lower(self, state, *rest):
        return self._for(state).lower(state, *rest)


def _donating_step(step_fn, compiler_options: CompilerOptions) -> StepFn:
    """`step_fn(state, frozen, batch, *rest)` jitted with the trained part of the state donated, as
    `step(state, batch, *rest)`, the new state laid out as the old (`_StateKeepingJit`). The frozen weights
    go in beside it, not donated: the rollout and the KL reference read the same buffers between steps.
    `.lower(state, batch, *rest)` lowers it (compiled plans)."""
    jitted = _StateKeepingJit(step_fn, compiler_options)

    def step(state: TrainState, batch: Batch, *rest) -> tuple[TrainState, Metrics]:
        new_state, metrics = jitted(state.replace(frozen=None), state.frozen, batch, *rest)
        return new_state.replace(frozen=state.frozen), metrics

    step.lower = lambda state, batch, *rest: jitted.lower(state.replace(frozen=None), state.frozen, batch, *rest)
    return step


# ------------------------------------------------------------------------------------------------
# Log-probs of completions




def completion_logprobs_and_entropy(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,  # [B, P+N] int32
    prompt_mask: jax.Array,  # [B, P] bool
    completion_mask: jax.Array,  # [B, N] bool
    temperature: float = 1.0,
    *,
    remat: str = "none",
    vocab_chunk: int = LOGPROB_VOCAB_CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs [B, N] and entropies [B, N] of the completion under log_softmax(logits / T);
    both 0 where completion_mask is False. Only the completion's slots reach the head, and the head
    runs over `vocab_chunk` vocabulary columns at a time (`chunked_logprobs_and_entropy`)."""
    if temperature <= 0:
        raise ValueError(f"log-probs need a sampling temperature > 0, got {temperature}")
    prompt_len, new_len = prompt_mask.shape[1], completion_mask.shape[1]
    if tokens.shape[1] != prompt_len + new_len:
        raise ValueError(f"tokens has {tokens.shape[1]} slots, expected P+N = {prompt_len}+{new_len}")
    kv_mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)  # [B, P+N]
    # Slot i predicts token i+1, so completion token j is scored by slot P+j-1: only those N slots'
    # hidden states are computed (the last layer and norm skip the rest).
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens, positions_from_mask(kv_mask), kv_mask,
                      output_slots=(prompt_len - 1, prompt_len + new_len - 1), remat=remat, hidden_only=True)
    # Pads after EOS may hold any id; point them at 0 so the gather stays in range.
    targets = jnp.where(completion_mask, tokens[:, prompt_len:], 0)  # [B, N]
    token_logp, entropy = chunked_logprobs_and_entropy(hidden, model.head_rows(), targets, temperature, vocab_chunk)
    return jnp.where(completion_mask, token_logp, 0.0), jnp.where(completion_mask, entropy, 0.0)


def chunked_logprobs_and_entropy(
    hidden: jax.Array,  # [B, N, D] final-normed hidden states
    head_rows: jax.Array,  # [V, D] output projection rows
    targets: jax.Array,  # [B, N] int32
    temperature: float,
    vocab_chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """log_softmax(hidden @ head_rows.T / T)[targets] and the entropy, without [B, N, V] logits.

    An online log-sum-exp over vocabulary chunks (running max m, sum s = sum exp(l - m) and
    t = sum exp(l - m) * l give logsumexp = m + log s and entropy = logsumexp - t / s). Each chunk is
    rematerialised, so the backward pass recomputes its logits instead of keeping them. The last
    chunk starts at V - C and masks the columns an earlier chunk already counted, so V need not be a
    multiple of C (Qwen3's 151,936 = 2^7 x 1187 has no useful divisor)."""
    vocab = head_rows.shape[0]
    chunk = min(vocab_chunk, vocab)
    num_chunks = -(-vocab // chunk)
    dt = hidden.dtype
    # The target's logit straight from its row: [B, N, D] . [B, N, D].
    target_logit = jnp.einsum("bnd,bnd->bn", hidden.astype(jnp.float32),
                              jnp.take(head_rows, targets, axis=0).astype(dt).astype(jnp.float32)) / temperature

    @jax.checkpoint
    def chunk_stats(carry, index):
        running_max, exp_sum, weighted_sum = carry
        start = jnp.minimum(index * chunk, vocab - chunk)
        rows = jax.lax.dynamic_slice_in_dim(head_rows, start, chunk, axis=0).astype(dt)  # [C, D]
        logits = jnp.einsum("bnd,cd->bnc", hidden, rows).astype(jnp.float32) / temperature  # [B, N, C]
        fresh = (start + jnp.arange(chunk)) >= index * chunk  # columns no earlier chunk counted
        logits_masked = jnp.where(fresh, logits, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(logits_masked, axis=-1))
        scale = jnp.exp(running_max - new_max)
        weights = jnp.exp(logits_masked - new_max[..., None])
        exp_sum = exp_sum * scale + jnp.sum(weights, axis=-1)
        weighted_sum = weighted_sum * scale + jnp.sum(jnp.where(fresh, weights * logits, 0.0), axis=-1)
        return (new_max, exp_sum, weighted_sum), None

    shape = target_logit.shape
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    if num_chunks == 1:
        (running_max, exp_sum, weighted_sum), _ = chunk_stats(init, 0)
    else:
        (running_max, exp_sum, weighted_sum), _ = jax.lax.scan(chunk_stats, init, jnp.arange(num_chunks))
    log_normaliser = running_max + jnp.log(exp_sum)
    return target_logit - log_normaliser, log_normaliser - weighted_sum / exp_sum


def sequence_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,  # [B, P+N]
    prompt_mask: jax.Array,  # [B, P]
    completion_mask: jax.Array,  # [B, N]
    temperature: float = 1.0,
) -> jax.Array:
    """Per-token log-probs [B, N] of the completion tokens (0 on pads), the sampler's convention
    log_softmax(logits / temperature). Pure; jit it (or use `make_logprobs_fn`)."""
    return completion_logprobs_and_entropy(graphdef, params, tokens, prompt_mask, completion_mask, temperature)[0]


def make_logprobs_fn(
    graphdef: nnx.GraphDef, temperature: float = 1.0, *, compiler_options: CompilerOptions = None,
) -> Callable[..., jax.Array]:
    """Jitted `fn(params, tokens, prompt_mask, completion_mask) -> [B, N]`, e.g. for reference log-probs."""
    return jax.jit(lambda params, tokens, prompt_mask, completion_mask: sequence_logprobs(
        graphdef, params, tokens, prompt_mask, completion_mask, temperature), compiler_options=compiler_options)


@functools.lru_cache(maxsize=16)
def reference_logprobs_fn(graphdef: nnx.GraphDef, temperature: float = 1.0) -> Callable[..., jax.Array]:
    """`make_logprobs_fn` once per (graph, temperature): a run's KL reference pass and the memory plan that
    compiled it ahead of time (locojax.compiled_plan) share one jitted function, and so its compilation."""
    return make_logprobs_fn(graphdef, temperature)


# ------------------------------------------------------------------------------------------------
# Shared step machinery


def _data_layout(mesh: Mesh | None) -> tuple[int, str]:
    """(devices the batch rows are split over, platform) of a step's mesh; default: one device."""
    if mesh is None:
        return 1, jax.default_backend()
    return mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1), mesh.devices.flat[0].platform


def _split_micro(batch: Mapping[str, jax.Array], num_micro: int) -> dict[str, jax.Array]:
    """[B, ...] -> [M, B/M, ...] with micro-batch k = rows k, k+M, k+2M, ...

    Strided rather than contiguous so that, with B sharded in contiguous blocks over devices, every
    micro-batch is spread over all devices: the reshape keeps the sharded axis (B/M) whole."""
    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]), 0, 1)

    return {k: split(v) for k, v in batch.items()}


def _accumulate(loss_fn, params: nnx.State, frozen, micro: Mapping[str, jax.Array], num_micro: int):
    """Sum of gradients and metrics of `loss_fn(params, frozen, micro_batch) -> (loss, metrics)` over the
    micro-batches, one at a time under `lax.scan` so only one micro-batch's activations are live.
    Gradients are taken with respect to `params` only (`frozen`: LoRA's base weights, or None)."""
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if num_micro == 1:
        return grad_fn(params, frozen, {k: v[0] for k, v in micro.items()})

    def body(grad_sum, micro_batch):
        grads, metrics = grad_fn(params, frozen, micro_batch)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return grad_sum, metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)  # accumulate in float32
    grad_sum, metrics = jax.lax.scan(body, zeros, micro)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grad_sum, params)  # keep opt_state dtypes stable
    return grads, jax.tree.map(lambda x: jnp.sum(x, axis=0), metrics)


def packed_data_parallel_grads(loss_fn, mesh: Mesh | None, num_micro: int, rows_per_micro: int):
    """`grads_fn(params, frozen, micro) -> (grads, metrics)` summed over the whole (sharded) batch.

    On a mesh whose only non-trivial axis is `data` (params replicated) and that splits every
    micro-batch evenly, each device accumulates its own rows' gradients and metrics under `shard_map`
    and one `psum` of them all, raveled into a single float buffer, makes them global: one collective
    per step instead of one per parameter (see the module docstring for why that matters across
    processes). Otherwise (one device, fsdp/tensor sharding, uneven rows) `jax.jit` places the
    collectives itself."""
    def plain(params, frozen, micro):
        return _accumulate(loss_fn, params, frozen, micro, num_micro)

    data = mesh.shape.get("data", 1) if mesh is not None else 1
    if data <= 1 or rows_per_micro % data or any(
            size > 1 for axis, size in mesh.shape.items() if axis != "data"):
        return plain

    def local(params, frozen, micro):
        grads, metrics = _accumulate(loss_fn, params, frozen, micro, num_micro)
        flat, unravel = ravel_pytree((grads, metrics))
        return unravel(jax.lax.psum(flat, "data"))

    # micro arrays are [M, B/M, ...] with the rows (axis 1) sharded over `data` (see _split_micro).
    # check_vma=False: with it, differentiating w.r.t. the replicated params would psum every
    # gradient leaf by itself (the transpose of the implicit pvary), which is what this avoids; here
    # `local` returns each device's partial sums and the one psum above adds them.
    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(None, "data")),
                         out_specs=PartitionSpec(), check_vma=False)


def _gradient_plan(loss_fn, batch: Mapping[str, jax.Array], micro_batch_size: int | None, mesh: Mesh | None):
    """(micro-batch count, `grads_fn(params, frozen, micro)`) of a step on `batch`: the count from
    `num_micro_batches` (the memory plan's rule) for this mesh's layout, the gradients from
    `packed_data_parallel_grads`."""
    batch_size, seq_len = batch["tokens"].shape[0], batch["tokens"].shape[1]
    num_micro = num_micro_batches(batch_size, micro_batch_size, seq_len, *_data_layout(mesh))
    return num_micro, packed_data_parallel_grads(loss_fn, mesh, num_micro, batch_size // num_micro)


def _apply(optimizer: Optimizer, params, opt_state, grads):
    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grad_norm


def _check_batch(batch: Batch, required: tuple[str, ...]) -> None:
    missing = [k for k in required if k not in batch]
    if missing:
        raise KeyError(f"batch lacks {missing}; see the layout in locojax.train")


# ------------------------------------------------------------------------------------------------
# GRPO


def _grpo_objective(graphdef: nnx.GraphDef, optimizer: Optimizer, algo: AlgoSpec, temperature: float):
    """The GRPO step's pieces that the fused step and the early-forward step share: the batch keys it
    reads, the loss as a function of the completion's log-probs (the params enter only through them),
    and the whole-batch inputs of that loss."""
    if optimizer.updates_per_step != algo.num_iterations:
        raise ValueError(
            f"optimizer built for {optimizer.updates_per_step} updates per step but algo.num_iterations is "
            f"{algo.num_iterations}; pass updates_per_step=algo.num_iterations to make_optimizer")
    if temperature <= 0:
        raise ValueError(f"training needs the sampling temperature > 0, got {temperature}")
    loss_weights_fn = LOSS_AGGREGATIONS.get(algo.loss_agg)
    policy_loss = POLICY_LOSSES.get(algo.loss)
    clip_low = algo.clip_eps
    clip_high = algo.clip_eps if algo.clip_eps_high is None else algo.clip_eps_high
    use_kl = algo.kl_coef > 0.0
    required = ("tokens", "prompt_mask", "completion_mask", "old_logprobs", "advantages") + (
        ("ref_logprobs",) if use_kl else ())

    def loss_of_logprobs(logp, entropy, mb):
        return policy_loss(
            logp, mb["old_logprobs"], mb["advantages"], mb["completion_mask"], mb["loss_weights"],
            mb["mean_weights"], clip_eps_low=clip_low, clip_eps_high=clip_high, kl_coef=algo.kl_coef,
            ref_logprobs=mb.get("ref_logprobs"), entropy=jax.lax.stop_gradient(entropy))

    def loss_inputs(batch: Batch) -> dict[str, jax.Array]:
        _check_batch(batch, required)
        completion_mask = batch["completion_mask"].astype(bool)
        inputs = {k: batch[k] for k in required}
        inputs["completion_mask"] = completion_mask
        # Whole-batch normalisers, computed before splitting (see locojax.algo.losses).
        inputs["loss_weights"] = loss_weights_fn(completion_mask)  # [B, N]
        inputs["mean_weights"] = token_mean_weights(completion_mask)  # [B, N]
        return inputs

    return required, loss_of_logprobs, loss_inputs


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    algo: AlgoSpec,
    *,
    temperature: float = 1.0,
    mesh: Mesh | None = None,
    remat: str = "none",
    jit: bool = True,
    compiler_options: CompilerOptions = None,
) -> StepFn:
    """The GRPO step: `num_iterations` AdamW updates on one batch, each over all micro-batches.

    Every iteration recomputes log-probs under the current params and takes its ratio against
    `batch["old_logprobs"]` from rollout (so iteration 1 of an on-policy step has ratio 1, and DA's
    one-step-stale batches get their importance correction the same way). Metrics are averaged
    over iterations; `optim/lr` is this step's learning rate.

    `algo.micro_batch_size` counts sequences of the global batch; under data parallelism make it a
    multiple of the `data` mesh axis size so each micro-batch splits evenly over the devices.
    `mesh`: the mesh the batch is sharded on; pass it to get one packed gradient all-reduce per step
    (`packed_data_parallel_grads`). `remat`: the model's activation rematerialisation (RunSpec
    model.remat).
    The state is donated when jitted: hold no other reference to its arrays (e.g. copy the initial
    params before using them as the frozen KL reference).
    """
    _, loss_of_logprobs, loss_inputs = _grpo_objective(graphdef, optimizer, algo, temperature)

    def loss_fn(params, frozen, mb):
        logp, entropy = completion_logprobs_and_entropy(
            graphdef, model_params(params, frozen), mb["tokens"], mb["prompt_mask"], mb["completion_mask"], temperature, remat=remat)
        return loss_of_logprobs(logp, entropy, mb)

    def train_step(state: TrainState, frozen, batch: Batch) -> tuple[TrainState, Metrics]:
        inputs = loss_inputs(batch)
        num_micro, grads_fn = _gradient_plan(loss_fn, batch, algo.micro_batch_size, mesh)
        micro = _split_micro(inputs, num_micro)

        def update(carry, _):
            params, opt_state = carry
            grads, metrics = grads_fn(params, frozen, micro)
            params, opt_state, grad_norm = _apply(optimizer, params, opt_state, grads)
            return (params, opt_state), {**metrics, m.POLICY_GRAD_NORM: grad_norm}

        if algo.num_iterations == 1:
            (params, opt_state), metrics = update((state.params, state.opt_state), None)
        else:
            (params, opt_state), metrics = jax.lax.scan(
                update, (state.params, state.opt_state), None, length=algo.num_iterations)
            metrics = {k: jnp.mean(v) for k, v in metrics.items()}  # over iterations
        metrics[m.OPTIM_LR] = optimizer.lr_schedule(state.step)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if jit:
        return _donating_step(train_step, compiler_options)
    return lambda state, batch: train_step(state.replace(frozen=None), state.frozen, batch)


# ------------------------------------------------------------------------------------------------
# GRPO with an early forward pass


def early_forward_applies(algo: AlgoSpec, mesh: Mesh | None, rows: int, seq_len: int) -> bool:
    """Whether a GRPO step on `rows` x `seq_len` can run as `EarlyForwardStep`: one update per step and the
    batch in one micro-batch. Its gradients are reduced by `jax.jit`, never packed: the packed reduction
    pays off across processes (gloo), and the early forward serves one process (locojax.modes.co)."""
    num_micro = num_micro_batches(rows, algo.micro_batch_size, seq_len, *_data_layout(mesh))
    return algo.num_iterations == 1 and num_micro == 1


@jax.tree_util.register_pytree_node_class
class SavedForward:
    """What the update's forward pass leaves for its backward: the completion's log-probs and entropies
    [B, N], and the residuals of `jax.vjp` (activations, and the weights in the form the backward reads
    them). A residual that *is* one of the forward's weight arguments is not kept a second time: the
    update takes it from its own arguments (`layout`, static: the vjp's tree and, per residual, its
    weight's index in (params, frozen) leaves or -1 for one of `residuals`)."""

    def __init__(self, logprobs: jax.Array, entropy: jax.Array, residuals: tuple, layout: tuple):
        self.logprobs, self.entropy, self.residuals, self.layout = logprobs, entropy, residuals, layout

    def tree_flatten(self):
        return (self.logprobs, self.entropy, self.residuals), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(*children, layout)


class EarlyForwardStep:
    """The GRPO step (one update, one micro-batch) as two programs, so the chip runs the forward pass
    while the host still scores the rewards: `forward(state, batch)` needs no advantages and returns a
    `SavedForward`; `update(state, batch, saved)` (the state donated) takes the loss's gradient
    with respect to the log-probs, pulls it back through the saved forward and applies AdamW. Same loss,
    gradients and metrics as `make_train_step`'s step. `lower_forward` and `lower_update` lower them from
    the same (abstract) arguments, for compiled plans."""

    def __init__(self, graphdef: nnx.GraphDef, optimizer: Optimizer, algo: AlgoSpec, *, temperature: float,
                 mesh: Mesh | None, remat: str, compiler_options: CompilerOptions = None):
        if algo.num_iterations != 1:
            raise ValueError(f"an early forward pass serves one update per step; algo.num_iterations is "
                             f"{algo.num_iterations}")
        required, loss_of_logprobs, loss_inputs = _grpo_objective(graphdef, optimizer, algo, temperature)
        self.forward_keys = tuple(k for k in required if k in ("tokens", "prompt_mask", "completion_mask"))

        def check_one_pass(batch):
            if not early_forward_applies(algo, mesh, batch["tokens"].shape[0], batch["tokens"].shape[1]):
                raise ValueError("an early forward pass needs the whole batch in one micro-batch")

        def forward(params, frozen, batch):
            check_one_pass(batch)
            completion_mask = batch["completion_mask"].astype(bool)

            def logprobs(trained):
                return completion_logprobs_and_entropy(
                    graphdef, model_params(trained, frozen), batch["tokens"], batch["prompt_mask"],
                    completion_mask, temperature, remat=remat)

            logp, pullback, entropy = jax.vjp(logprobs, params, has_aux=True)
            leaves, tree = jax.tree.flatten(pullback)
            weights = {id(leaf): index for index, leaf in enumerate(jax.tree.leaves((params, frozen)))}
            slots = tuple(weights.get(id(leaf), -1) for leaf in leaves)
            residuals = tuple(leaf for leaf, slot in zip(leaves, slots) if slot < 0)
            return SavedForward(logp, entropy, residuals, (tree, slots))

        def update(state: TrainState, frozen, batch: Batch, saved: SavedForward) -> tuple[TrainState, Metrics]:
            inputs = loss_inputs(batch)
            tree, slots = saved.layout
            weights, residuals = jax.tree.leaves((state.params, frozen)), iter(saved.residuals)
            pullback = jax.tree.unflatten(tree, [weights[slot] if slot >= 0 else next(residuals) for slot in slots])
            (_, metrics), logp_grad = jax.value_and_grad(loss_of_logprobs, has_aux=True)(
                saved.logprobs, saved.entropy, inputs)
            (grads,) = pullback(logp_grad)
            params, opt_state, grad_norm = _apply(optimizer, state.params, state.opt_state, grads)
            metrics = {**metrics, m.POLICY_GRAD_NORM: grad_norm, m.OPTIM_LR: optimizer.lr_schedule(state.step)}
            return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

        self._forward = jax.jit(forward, compiler_options=compiler_options)
        # The saved forward is not donated: no output of the update has a residual's shape, so XLA could
        # reuse none of them; the caller lets go of it once the update is dispatched.
        self.update = _donating_step(update, compiler_options)
        self.lower_update = self.update.lower

    def _forward_args(self, state: TrainState, batch: Batch):
        return state.params, state.frozen, {k: batch[k] for k in self.forward_keys}

    def forward(self, state: TrainState, batch: Batch) -> SavedForward:
        """Dispatch the forward pass on the state's params (not donated) and the batch's rows."""
        return self._forward(*self._forward_args(state, batch))

    def lower_forward(self, state: TrainState, batch: Batch):
        return self._forward.lower(*self._forward_args(state, batch))



# ------------------------------------------------------------------------------------------------
# SFT


def make_sft_step(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    *,
    micro_batch_size: int | None = None,
    mesh: Mesh | None = None,
    remat: str = "none",
    jit: bool = True,
    compiler_options: CompilerOptions = None,
) -> StepFn:
    """Teacher-forced SFT: mean cross-entropy over completion tokens (prompt tokens carry no loss),
    one update per step, same optimizer and micro-batching as the GRPO step. Metrics: `loss/sft`
    (before the update), `policy/grad_norm`, `optim/lr`."""

    def loss_fn(params, frozen, mb):
        logp, _ = completion_logprobs_and_entropy(
            graphdef, model_params(params, frozen), mb["tokens"], mb["prompt_mask"], mb["completion_mask"], 1.0, remat=remat)
        loss = -jnp.sum(mb["mean_weights"] * logp)
        return loss, {m.LOSS_SFT: loss}

    def sft_step(state: TrainState, frozen, batch: Batch) -> tuple[TrainState, Metrics]:
        _check_batch(batch, ("tokens", "prompt_mask", "completion_mask"))
        completion_mask = batch["completion_mask"].astype(bool)
        num_micro, grads_fn = _gradient_plan(loss_fn, batch, micro_batch_size, mesh)
        inputs = {"tokens": batch["tokens"], "prompt_mask": batch["prompt_mask"],
                  "completion_mask": completion_mask, "mean_weights": token_mean_weights(completion_mask)}
        grads, metrics = grads_fn(state.params, frozen, _split_micro(inputs, num_micro))
        params, opt_state, grad_norm = _apply(optimizer, state.params, state.opt_state, grads)
        metrics = {**metrics, m.POLICY_GRAD_NORM: grad_norm, m.OPTIM_LR: optimizer.lr_schedule(state.step)}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if jit:
        return _donating_step(sft_step, compiler_options)
    return lambda state, batch: sft_step(state.replace(frozen=None), state.frozen, batch)


def tokens_in_batch(batch: Batch) -> int:
    """Real (unpadded) prompt + completion tokens, for throughput/train_tokens_per_s."""
    return int(jnp.sum(batch["prompt_mask"]) + jnp.sum(batch["completion_mask"]))


__all__ = [
    "Batch", "CompilerOptions", "EarlyForwardStep", "LOGPROB_VOCAB_CHUNK", "Metrics", "Optimizer", "SavedForward",
    "StepFn", "TrainState", "early_forward_applies",
    "chunked_logprobs_and_entropy", "completion_logprobs_and_entropy",
    "init_train_state", "lr_schedule", "make_logprobs_fn", "make_optimizer", "make_sft_step",
    "make_train_step", "model_params", "packed_data_parallel_grads", "reference_logprobs_fn", "sequence_logprobs", "split_params", "tokens_in_batch",
]
