"""The jitted GRPO and SFT steps on the `tiny` preset: log-prob alignment, exact gradient accumulation,
data-parallel sharding, num_iterations, the optimizer schedule, donation, and SFT learning.

Compiles are the cost here (seconds each on a shared 2-core machine), so jitted steps are built once
per module and reused."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from locojax import metrics as m
from locojax.model import LoRAConfig, create_model, forward, get_preset
from locojax.spec import AlgoSpec, OptimSpec
from locojax.train import (
    EarlyForwardStep, Optimizer, early_forward_applies, init_train_state, lr_schedule, make_logprobs_fn,
    make_optimizer, make_sft_step, make_train_step, decays, split_params,
)

B, P, N = 8, 6, 5  # sequences, prompt slots, completion slots
TEMPERATURE = 0.7
ALGO = AlgoSpec(name="grpo", clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05, loss_agg="seq_mean_token_mean")


# Halves XLA's CPU compile time; compiles dominate this module's run time on a shared 2-core machine.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.lru_cache(maxsize=None)
def tiny_model():
    """(graphdef, params) of the tiny preset. Parameters are drawn with numpy into the model's abstract
    state (fan-in scaled, norm scales 1): the model's own eager init compiles an op per shape, which
    costs seconds here, and these tests do not depend on its exact values."""
    graphdef, abstract = split_params(nnx.eval_shape(lambda: create_model(get_preset("tiny"), seed=0)))
    rng = np.random.default_rng(0)

    def draw(leaf):
        if leaf.ndim == 1:
            return jnp.ones(leaf.shape, leaf.dtype)
        fan_in = leaf.shape[1] if leaf.shape[0] == get_preset("tiny").vocab_size else leaf.shape[0]
        return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(fan_in), leaf.dtype)

    return graphdef, jax.tree.map(draw, abstract)


def fresh_params():
    """Private buffers: jitted steps donate their input state."""
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x)), tiny_model()[1])


def sgd(lr: float, updates_per_step: int = 1) -> Optimizer:
    """Plain SGD makes `params_after - params_before = -lr * grad` exactly, so two steps agree to
    float32 tolerance iff their gradients do (Adam's g/|g| would amplify rounding of tiny gradients)."""
    return Optimizer(tx=optax.sgd(lr), lr_schedule=lambda step: jnp.float32(lr), updates_per_step=updates_per_step)


@functools.lru_cache(maxsize=None)
def batch_arrays():
    """A fixed GRPO batch with ragged prompts (left pads) and ragged completions (pads after EOS)."""
    graphdef, params = tiny_model()
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 256, (B, P + N)).astype(np.int32)
    prompt_mask = np.ones((B, P), bool)
    for row, pads in enumerate(rng.integers(0, 3, B)):
        prompt_mask[row, :pads] = False
        tokens[row, :pads] = 0
    completion_mask = np.arange(N)[None, :] < rng.integers(1, N + 1, B)[:, None]
    tokens[:, P:][~completion_mask] = 0
    logprobs_fn = make_logprobs_fn(graphdef, TEMPERATURE, compiler_options=FAST_COMPILE)
    logprobs = np.asarray(logprobs_fn(params, tokens, prompt_mask, completion_mask))
    # Old and reference log-probs a little off the current policy, so ratios differ from 1, some
    # tokens clip and the KL is positive.
    old = np.where(completion_mask, logprobs + 0.3 * rng.normal(size=(B, N)), 0.0).astype(np.float32)
    ref = np.where(completion_mask, logprobs + 0.2 * rng.normal(size=(B, N)), 0.0).astype(np.float32)
    return dict(tokens=tokens, prompt_mask=prompt_mask, completion_mask=completion_mask, old_logprobs=old,
                ref_logprobs=ref, advantages=rng.normal(size=B).astype(np.float32)), logprobs


def batch():
    return dict(batch_arrays()[0])


@functools.lru_cache(maxsize=None)
def full_batch_sgd_step():
    return make_train_step(tiny_model()[0], sgd(0.5), ALGO, temperature=TEMPERATURE, compiler_options=FAST_COMPILE)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_logprobs_align_with_an_unpadded_forward():
    """Completion token j is scored by slot P+j-1 under log_softmax(logits / T), with the left
    padding masked and rotary positions starting at the first real token."""
    graphdef, params = tiny_model()
    data, logprobs = batch_arrays()
    ragged = (data["prompt_mask"].sum(1) < P) & (data["completion_mask"].sum(1) < N)
    row = int(np.flatnonzero(ragged)[0])  # left padding and pads after EOS
    pads = P - int(data["prompt_mask"][row].sum())
    length = int(data["completion_mask"][row].sum())
    seq = data["tokens"][row, pads : P + length][None]  # [1, L] unpadded prompt + completion
    run = jax.jit(lambda p, t: forward(graphdef, p, t, jnp.arange(t.shape[1])[None], jnp.ones(t.shape, bool))[0],
                  compiler_options=FAST_COMPILE)
    logits = np.asarray(run(params, seq))[0].astype(np.float64) / TEMPERATURE  # [L, V]
    prompt_len = P - pads
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = [log_softmax[prompt_len + j - 1, seq[0, prompt_len + j]] for j in range(length)]
    np.testing.assert_allclose(logprobs[row, :length], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(logprobs[row, length:], 0.0)  # pads after EOS


def test_train_step_runs_reports_and_donates():
    graphdef, _ = tiny_model()
    state = init_train_state(fresh_params(), sgd(0.5), seed=7)
    new_state, metrics = full_batch_sgd_step()(state, batch())
    assert state.params["embed"][...].is_deleted()  # donated: the step reused the buffers
    assert int(new_state.step) == 1
    np.testing.assert_array_equal(new_state.rng, jax.random.PRNGKey(7))  # the step leaves the key alone
    metrics = {k: float(v) for k, v in metrics.items()}
    assert set(metrics) == {m.LOSS_POLICY, m.LOSS_KL, m.LOSS_TOTAL, m.POLICY_ENTROPY, m.POLICY_CLIP_FRAC,
                            m.POLICY_GRAD_NORM, m.OPTIM_LR}
    assert metrics[m.LOSS_KL] > 0.0 and 0.0 < metrics[m.POLICY_CLIP_FRAC] < 1.0
    assert metrics[m.LOSS_TOTAL] == pytest.approx(metrics[m.LOSS_POLICY] + ALGO.kl_coef * metrics[m.LOSS_KL], rel=1e-5)
    assert 0.0 < metrics[m.POLICY_ENTROPY] <= np.log(get_preset("tiny").vocab_size)
    assert metrics[m.POLICY_GRAD_NORM] > 0.0 and metrics[m.OPTIM_LR] == pytest.approx(0.5)


def gradient_all_reduces(compiled_text: str) -> list[str]:
    """The all-reduce instructions of a compiled step that carry more than a few scalars."""
    lines = [line for line in compiled_text.splitlines() if re.search(r"= .*\ball-reduce(-start)?\(", line)]
    return [line for line in lines if not re.match(r"\s*%\S+ = \(?f32\[\](, f32\[\])*\)? all-reduce", line)]


# packed: the step is given the mesh, reduces gradients as one buffer (2 rows of each micro-batch per
# device); jit: no mesh, jax.jit places the collectives (micro-batches of 2 rows over 4 devices).
@pytest.mark.usefixtures("four_cpu_devices")
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "jit"])
def test_micro_batches_on_a_sharded_mesh_equal_the_full_batch(packed):
    """Micro-batches over a batch sharded on 4 devices give the full-batch update (float32)."""
    graphdef, _ = tiny_model()
    full_state, full_metrics = full_batch_sgd_step()(init_train_state(fresh_params(), sgd(0.5)), batch())

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    replicated, by_row = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    state = jax.device_put(init_train_state(fresh_params(), sgd(0.5)), replicated)
    sharded_batch = jax.device_put(batch(), by_row)
    algo = ALGO.model_copy(update={"micro_batch_size": B // 2 if packed else B // 4})
    step = make_train_step(graphdef, sgd(0.5), algo, temperature=TEMPERATURE, mesh=mesh if packed else None,
                           compiler_options=FAST_COMPILE)
    reductions = gradient_all_reduces(step.lower(state, sharded_batch).compile().as_text())
    if packed:  # one flat buffer: every gradient and metric, nothing per parameter
        assert len(reductions) == 1 and "(f32[" not in reductions[0].split("all-reduce")[0], reductions
    else:  # what the packing avoids: a tuple with one element per parameter
        assert reductions and reductions[0].count("f32[") > len(jax.tree.leaves(tiny_model()[1])), reductions
    micro_state, micro_metrics = step(state, sharded_batch)

    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                         full_state.params, tiny_model()[1])
    assert max(jax.tree.leaves(moved)) > 1e-3  # the update is not trivially zero
    assert_trees_close(micro_state.params, full_state.params)
    for name, value in full_metrics.items():
        # The k3 KL sums exp(d) - d - 1 over tokens: terms near 1 cancelling to ~1e-2, so a change of
        # summation order (micro-batches) moves it by ~100 float32 ulps of its terms, 1e-5 of itself.
        rel = 1e-4 if name == m.LOSS_KL else 1e-5
        assert float(micro_metrics[name]) == pytest.approx(float(value), rel=rel, abs=1e-7), name
    assert micro_state.params["embed"][...].sharding.is_fully_replicated


def test_num_iterations_two_equals_two_updates_on_the_same_batch():
    graphdef, _ = tiny_model()
    step_once = full_batch_sgd_step()
    state = init_train_state(fresh_params(), sgd(0.5))
    state, first = step_once(state, batch())
    # What a step that reused the first gradient (ignoring the updated params) would give: p0 + 2 (p1 - p0).
    reused = jax.tree.map(lambda p1, p0: np.asarray(p0) + 2 * (np.asarray(p1) - np.asarray(p0)),
                          state.params, tiny_model()[1])
    state, second = step_once(state, batch())

    twice = make_train_step(graphdef, sgd(0.5, updates_per_step=2), ALGO.model_copy(update={"num_iterations": 2}),
                            temperature=TEMPERATURE, compiler_options=FAST_COMPILE)
    double_state, double = twice(init_train_state(fresh_params(), sgd(0.5, 2)), batch())
    assert int(double_state.step) == 1  # one train step, two updates
    # Two programs (scan vs two calls) round differently, and at lr 0.5 the second gradient amplifies it
    # (tokens near a clip boundary); 1e-4 is still far below the gap to the wrong answer.
    assert_trees_close(double_state.params, state.params, rtol=1e-4, atol=1e-4)
    gap = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), double_state.params, reused)
    assert max(jax.tree.leaves(gap)) > 1e-2
    # Metrics are the mean over the two iterations; the second one sees ratios moved by the first.
    for name in (m.LOSS_POLICY, m.POLICY_CLIP_FRAC, m.POLICY_GRAD_NORM):
        assert float(double[name]) == pytest.approx((float(first[name]) + float(second[name])) / 2, rel=1e-4), name
    assert float(first[m.LOSS_POLICY]) != pytest.approx(float(second[m.LOSS_POLICY]), rel=1e-3)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_early_forward_step_equals_the_fused_step(lora):
    """Forward first (no advantages), then the update from what it saved: the same params, optimizer
    state and metrics as the one-program step, the saved forward's weights not kept twice, and the
    state donated."""
    graphdef, params = tiny_model()
    optimizer = make_optimizer(OptimSpec(lr=1e-2, warmup_steps=0), total_steps=4)
    if lora:
        model = create_model(get_preset("tiny").replace(lora=LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "up"))),
                             seed=0)
        graphdef, params = split_params(model)

    def fresh_state():
        return init_train_state(jax.tree.map(lambda x: jax.device_put(np.asarray(x)), params), optimizer, lora=lora)

    fused = make_train_step(graphdef, optimizer, ALGO, temperature=TEMPERATURE, compiler_options=FAST_COMPILE)
    early = EarlyForwardStep(graphdef, optimizer, ALGO, temperature=TEMPERATURE, mesh=None, remat="none",
                             compiler_options=FAST_COMPILE)
    expected_state, expected = fused(fresh_state(), batch())
    state, rows = fresh_state(), batch()
    without_advantages = {k: v for k, v in rows.items() if k != "advantages"}
    saved = early.forward(state, without_advantages)  # dispatched before the advantages exist
    tree, slots = saved.layout
    assert any(slot >= 0 for slot in slots) or not lora  # LoRA's frozen weights are read, not copied
    assert len(saved.residuals) == sum(slot < 0 for slot in slots)
    new_state, metrics = early.update(state, rows, saved)
    assert jax.tree.leaves(state.params)[0].is_deleted()
    assert int(new_state.step) == 1
    # Within 0.1% of the step's lr (1e-2): AdamW divides each element's gradient by its own scale, so an
    # element whose gradient is ~0 moves by a rounding-dependent part of lr (2.7e-6 seen under load).
    assert_trees_close(new_state.params, expected_state.params, rtol=1e-5, atol=1e-3 * 1e-2)
    assert_trees_close(new_state.opt_state, expected_state.opt_state, rtol=1e-4, atol=1e-7)
    assert set(metrics) == set(expected)
    for name in expected:
        assert float(metrics[name]) == pytest.approx(float(expected[name]), rel=1e-5, abs=1e-7), name
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fresh_state().params),
                                                       jax.tree.leaves(new_state.params))]
    # LoRA's A matrices get no gradient while B is still zero: its B matrices move at step 0.
    assert all(moved) if not lora else sum(moved) == len(moved) // 2


def test_the_early_forward_step_applies_to_one_update_in_one_micro_batch():
    rows, seq_len = 16, 32
    assert early_forward_applies(ALGO.model_copy(update={"micro_batch_size": 16}), None, rows, seq_len)
    assert not early_forward_applies(ALGO.model_copy(update={"micro_batch_size": 8}), None, rows, seq_len)
    two = ALGO.model_copy(update={"num_iterations": 2, "micro_batch_size": 16})
    assert not early_forward_applies(two, None, rows, seq_len)
    with pytest.raises(ValueError, match="num_iterations is 2"):
        EarlyForwardStep(tiny_model()[0], sgd(0.5, 2), two, temperature=1.0, mesh=None, remat="none")


def test_step_rejects_bad_configuration():
    graphdef, _ = tiny_model()
    assert B % 3  # micro_batch_size 3 must not divide the batch
    with pytest.raises(ValueError, match="num_iterations"):
        make_train_step(graphdef, sgd(0.1), ALGO.model_copy(update={"num_iterations": 2}))
    with pytest.raises(ValueError, match="temperature"):
        make_train_step(graphdef, sgd(0.1), ALGO, temperature=0.0)
    state = init_train_state(fresh_params(), sgd(0.1))
    step = make_train_step(graphdef, sgd(0.1), ALGO.model_copy(update={"micro_batch_size": 3}), jit=False)
    with pytest.raises(ValueError, match="micro_batch_size 3"):
        jax.eval_shape(step, state, batch())
    without_ref = {k: v for k, v in batch().items() if k != "ref_logprobs"}
    with pytest.raises(KeyError, match="ref_logprobs"):
        jax.eval_shape(make_train_step(graphdef, sgd(0.1), ALGO, jit=False), state, without_ref)


def test_lr_schedule_warmup_constant_and_cosine():
    def at(optim, steps):  # one compile instead of an eager op per call
        return np.asarray(jax.jit(jax.vmap(lr_schedule(optim, total_steps=10)))(jnp.asarray(steps)))

    np.testing.assert_allclose(at(OptimSpec(lr=1.0, warmup_steps=4, decay="constant"), [0, 1, 2, 3, 4, 5]),
                               [0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(at(OptimSpec(lr=1.0, warmup_steps=4, decay="cosine"), [0, 4, 7, 10, 12]),
                               [0.25, 1.0, 0.5, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(at(OptimSpec(lr=0.3, warmup_steps=0), [0, 9]), [0.3, 0.3])


def test_optimizer_counts_warmup_in_train_steps_and_decays_only_matrices():
    optim = OptimSpec(lr=1.0, warmup_steps=2, weight_decay=0.0, grad_clip=1e6)
    optimizer = make_optimizer(optim, total_steps=10, updates_per_step=2)
    params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    opt_state = optimizer.tx.init(params)
    update = jax.jit(optimizer.tx.update)
    sizes = []
    for _ in range(4):  # train steps 0, 0, 1, 1: lr 0.5, 0.5, 1, 1 (Adam's first moves are ~lr)
        updates, opt_state = update(jax.tree.map(jnp.ones_like, params), opt_state, params)
        sizes.append(float(-updates["b"][0]))
    # A TPU's float32 sqrt and division in Adam are good to ~3e-4 relative (measured), not 1e-4.
    np.testing.assert_allclose(sizes, [0.5, 0.5, 1.0, 1.0], rtol=1e-4 if jax.default_backend() == "cpu" else 1e-3)

    decaying = make_optimizer(OptimSpec(lr=1.0, warmup_steps=0, weight_decay=0.1), total_steps=10)
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    updates, _ = jax.jit(decaying.tx.update)(jax.tree.map(jnp.zeros_like, params), decaying.tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1)  # lr * weight_decay * w
    np.testing.assert_allclose(updates["b"], 0.0)  # vectors (norm scales) are not decayed

    # The model's decoder layers are stacked [L, ...]: a norm scale there is [L, D], still not decayed.
    mask = jax.tree_util.tree_leaves_with_path(decays(fresh_params()))
    decayed = {jax.tree_util.keystr(path) for path, on in mask if on}
    assert decayed and not any("norm" in name for name in decayed), decayed
    assert all("norm" in jax.tree_util.keystr(path) for path, on in mask if not on), mask
    assert any("layers" in name and "proj" in name for name in decayed) and any("embed" in name for name in decayed)


def test_sft_steps_reduce_the_loss_on_a_fixed_dataset():
    """Teacher forcing on B fixed prompt -> completion pairs: the completion cross-entropy falls."""
    graphdef, _ = tiny_model()
    data = batch()
    sft_batch = {k: data[k] for k in ("tokens", "prompt_mask", "completion_mask")}
    optimizer = make_optimizer(OptimSpec(lr=3e-3, warmup_steps=0), total_steps=20)
    step = make_sft_step(graphdef, optimizer, compiler_options=FAST_COMPILE)
    state = init_train_state(fresh_params(), optimizer)
    losses = []
    for _ in range(10):
        state, metrics = step(state, sft_batch)
        losses.append(float(metrics[m.LOSS_SFT]))
    assert losses[0] > 4.0  # ~log(384) for a random model
    assert losses[-1] < 0.7 * losses[0], losses
    assert int(state.step) == 10


def test_cpu_steps_split_large_batches_into_micro_batches_of_bounded_slots():
    """Unset micro_batch_size: on CPU each device's rows are halved until a micro-batch holds at most
    CPU_MICRO_BATCH_SLOTS token slots (page faults of XLA:CPU's per-call buffer dominate beyond);
    accelerators and an explicit micro_batch_size are left alone."""
    from locojax.placement.memory import CPU_MICRO_BATCH_SLOTS, num_micro_batches

    assert CPU_MICRO_BATCH_SLOTS == 8192
    assert num_micro_batches(512, None, 104, 1, "cpu") == 8  # 64 rows x 104 slots each
    assert num_micro_batches(1024, None, 104, 2, "cpu") == 8  # per device, as above
    assert num_micro_batches(64, None, 128, 1, "cpu") == 1  # exactly 8192 slots: whole
    assert num_micro_batches(96, None, 512, 1, "cpu") == 8  # 12 rows x 512 slots each
    assert num_micro_batches(6, None, 4096, 1, "cpu") == 2  # 3 rows: odd, cannot be halved evenly again
    assert num_micro_batches(512, None, 104, 1, "tpu") == 1
    assert num_micro_batches(512, 128, 104, 1, "cpu") == 4
