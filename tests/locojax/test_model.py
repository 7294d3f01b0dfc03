"""The decoder: catalog sizes, KV-cache consistency, sharded execution, scanned vs unrolled layers."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from locojax.compiled_plan import program_temporaries
from locojax.model import PRESETS, create_model, forward, get_preset, init_cache, param_count, positions_from_mask
from locojax.model.config import PUBLISHED_PARAMS, UNROLLED_LAYERS_MAX, ModelConfig
from locojax.model.sharding import batch_sharding, logical_to_spec, make_mesh, shard_state

jit_forward = jax.jit(forward, static_argnums=0)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_published_size(name):
    count = param_count(PRESETS[name])
    assert abs(count - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < 0.005


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_param_count_equals_built_model(name):
    _, state = nnx.split(create_model(get_preset(name)))
    assert sum(leaf.size for leaf in jax.tree.leaves(state)) == param_count(get_preset(name))


def test_small_preset_has_benchmark_dims():
    c = get_preset("small")
    assert (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (256, 4, 4, 4, 64, 1024)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="n_kv_heads"):
        get_preset("tiny").replace(n_heads=4, n_kv_heads=3)
    with pytest.raises(KeyError, match="unknown model preset"):
        get_preset("gpt-5")


def _left_padded_batch(config: ModelConfig, batch=3, length=12, seed=1):
    tokens = jax.random.randint(jax.random.key(seed), (batch, length), 0, config.vocab_size)
    mask = jnp.ones((batch, length), bool).at[0, :4].set(False).at[1, :1].set(False)
    return tokens, mask, positions_from_mask(mask)


@pytest.mark.parametrize("tie", [True, False])
def test_prefill_then_cached_decode_equals_full_forward(tie):
    config = get_preset("tiny").replace(tie_embeddings=tie)
    graphdef, params = nnx.split(create_model(config, seed=3))
    tokens, mask, positions = _left_padded_batch(config)
    full, _ = jit_forward(graphdef, params, tokens, positions, mask)

    prompt_len, total = 7, tokens.shape[1]
    cache = init_cache(config, tokens.shape[0], total + 4)  # spare slots stay masked out
    kv_mask = jnp.concatenate([mask, jnp.zeros((tokens.shape[0], 4), bool)], axis=1)
    logits, cache = jit_forward(graphdef, params, tokens[:, :prompt_len], positions[:, :prompt_len], kv_mask,
                                cache, 0)
    # A prefill that keeps only its last slot's logits (what rollout samples from) writes the same cache.
    last, last_cache = jax.jit(forward, static_argnums=0, static_argnames="output_slots")(
        graphdef, params, tokens[:, :prompt_len], positions[:, :prompt_len], kv_mask,
        init_cache(config, tokens.shape[0], total + 4), 0, output_slots=(prompt_len - 1, prompt_len))
    assert last.shape == (tokens.shape[0], 1, config.vocab_size)
    np.testing.assert_allclose(np.asarray(last), np.asarray(logits[:, -1:]), atol=1e-5)
    for ours, theirs in zip(jax.tree.leaves(last_cache), jax.tree.leaves(cache)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-6)
    pieces = [logits]
    for i in range(prompt_len, total):
        logits, cache = jit_forward(graphdef, params, tokens[:, i:i + 1], positions[:, i:i + 1], kv_mask, cache, i)
        pieces.append(logits)
    incremental = jnp.concatenate(pieces, axis=1)
    real = np.asarray(mask)
    assert np.abs(np.asarray(incremental - full))[real].max() <= 1e-5


def test_left_padding_does_not_change_real_token_logits():
    config = get_preset("tiny")
    graphdef, params = nnx.split(create_model(config, seed=0))
    row = jax.random.randint(jax.random.key(5), (1, 6), 0, config.vocab_size)
    alone, _ = jit_forward(graphdef, params, row, jnp.arange(6)[None], jnp.ones((1, 6), bool))
    padded = jnp.concatenate([jnp.zeros((1, 3), row.dtype), row], axis=1)
    mask = jnp.arange(9)[None] >= 3
    out, _ = jit_forward(graphdef, params, padded, positions_from_mask(mask), mask)
    np.testing.assert_allclose(np.asarray(out[:, 3:]), np.asarray(alone), atol=1e-5)


@pytest.mark.usefixtures("four_cpu_devices")
def test_sharded_forward_on_four_devices_equals_unsharded():
    assert jax.device_count() == 4, "tests/locojax/conftest.py asks for 4 CPU devices"
    config = get_preset("tiny")
    graphdef, params = nnx.split(create_model(config, seed=0))
    tokens, mask, positions = _left_padded_batch(config, batch=4)
    reference, _ = jit_forward(graphdef, params, tokens, positions, mask)

    mesh = make_mesh(fsdp=2, tensor=2)
    sharded_params = shard_state(params, mesh)
    q_proj = sharded_params["layers"]["attention"]["q_proj"][...]  # [L, H, Dh, D]: the layer axis is not sharded
    assert len(q_proj.sharding.device_set) == 4
    assert q_proj.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None, "fsdp")
    place = batch_sharding(mesh, 2)
    out, _ = jit_forward(graphdef, sharded_params, jax.device_put(tokens, place), jax.device_put(positions, place),
                         jax.device_put(mask, place))
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=1e-5)


@pytest.mark.usefixtures("four_cpu_devices")
def test_rules_replicate_axes_the_mesh_does_not_divide():
    mesh = make_mesh(tensor=4)
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == jax.sharding.PartitionSpec(
        None, None, None)
    assert logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh) == jax.sharding.PartitionSpec(
        None, "tensor", None)


def test_bfloat16_compute_runs_and_returns_float32_logits():
    config = get_preset("tiny").replace(param_dtype="bfloat16", dtype="bfloat16")
    graphdef, params = nnx.split(create_model(config))
    tokens, mask, positions = _left_padded_batch(config)
    logits, _ = jit_forward(graphdef, params, tokens, positions, mask)
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_output_slots_give_the_full_forwards_logits_and_gradients_for_those_slots():
    """The training path computes logits only for the completion's slots (the last layer, norm and
    head skip the rest); values and parameter gradients must match slicing the full logits."""
    config = get_preset("tiny")
    graphdef, params = nnx.split(create_model(config, seed=2))
    tokens, mask, positions = _left_padded_batch(config)
    weights = jax.random.normal(jax.random.key(7), (tokens.shape[0], 6, config.vocab_size))

    def loss(p, slots):
        if slots is None:
            logits = forward(graphdef, p, tokens, positions, mask)[0][:, 5:11]
        else:
            logits = forward(graphdef, p, tokens, positions, mask, output_slots=slots)[0]
        return jnp.sum(weights * jax.nn.log_softmax(logits)), logits

    (_, full), full_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, None), has_aux=True))(params)
    (_, part), part_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, (5, 11)), has_aux=True))(params)
    assert part.shape == (tokens.shape[0], 6, config.vocab_size)
    np.testing.assert_allclose(np.asarray(part), np.asarray(full), atol=1e-5)
    for a, b in zip(jax.tree.leaves(part_grads), jax.tree.leaves(full_grads)):  # float32 rounding only
        assert np.abs(np.asarray(a - b)).max() <= 1e-5 * max(1.0, float(np.abs(np.asarray(b)).max()))
    with pytest.raises(ValueError, match="output_slots"):
        forward(graphdef, params, tokens, positions, mask, output_slots=(5, 13))


def test_swiglu_gradient_equals_autodiff_of_silu_times_up():
    from locojax.model.transformer import _swiglu

    gate, up, cotangent = (jax.random.normal(jax.random.key(i), (16, 32)) * 4 for i in range(3))
    ours = jax.vjp(_swiglu, gate, up)
    plain = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
    np.testing.assert_allclose(np.asarray(ours[0]), np.asarray(plain[0]), rtol=1e-6)
    for a, b in zip(ours[1](cotangent), plain[1](cotangent)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_tabulated_rotary_angles_equal_the_direct_ones():
    from locojax.model.transformer import rope_angles

    positions = jnp.array([[0, 0, 1, 2, 300], [5, 6, 7, 8, 511]])
    direct = rope_angles(positions, 16, 10_000.0)
    table = rope_angles(positions, 16, 10_000.0, num_positions=512)
    for a, b in zip(direct, table):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# Scanned and unrolled layers: three layers, so the scan runs over more than one (two before a last
# layer that runs on its own for `output_slots`); qwen3 tied and untied, and llama (no QK-norm).
STACK_CONFIGS = {
    "qwen3-tied": get_preset("tiny").replace(n_layers=3),
    "qwen3-untied": get_preset("tiny").replace(n_layers=3, tie_embeddings=False),
    "llama": get_preset("tiny").replace(n_layers=3, arch="llama", qk_norm=False, tie_embeddings=False),
}


def _scanned_and_unrolled(config: ModelConfig):
    """The graphdefs of the same model scanning and unrolling its layers, and its one set of params."""
    graphdef, params = nnx.split(create_model(config.replace(scan_layers=True), seed=4))
    unrolled, unrolled_params = nnx.split(create_model(config.replace(scan_layers=False), seed=4))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, unrolled_params))
    return graphdef, unrolled, params


def _assert_trees_close(actual, expected, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= rtol * max(1.0, float(np.abs(b).max())), np.abs(a - b).max()


@pytest.mark.parametrize("name,remat,output_slots", [
    ("qwen3-tied", "none", None), ("qwen3-tied", "full", (5, 11)), ("qwen3-untied", "none", (5, 11)),
    ("qwen3-untied", "full", None), ("qwen3-untied", "dots", (5, 11)), ("llama", "none", (5, 11)),
    ("llama", "full", None)])
def test_scanned_layers_give_the_unrolled_logits_and_gradients(name, remat, output_slots):
    config = STACK_CONFIGS[name]
    scanned, unrolled, params = _scanned_and_unrolled(config)
    tokens, mask, positions = _left_padded_batch(config)
    width = 6 if output_slots else tokens.shape[1]
    weights = jax.random.normal(jax.random.key(7), (tokens.shape[0], width, config.vocab_size))

    def loss(graphdef, p):
        logits = forward(graphdef, p, tokens, positions, mask, output_slots=output_slots, remat=remat)[0]
        return jnp.sum(weights * jax.nn.log_softmax(logits)), logits

    (_, scanned_logits), scanned_grads = jax.jit(
        jax.value_and_grad(functools.partial(loss, scanned), has_aux=True))(params)
    (_, unrolled_logits), unrolled_grads = jax.jit(
        jax.value_and_grad(functools.partial(loss, unrolled), has_aux=True))(params)
    assert scanned_logits.shape == (tokens.shape[0], width, config.vocab_size)
    _assert_trees_close(scanned_logits, unrolled_logits)
    _assert_trees_close(scanned_grads, unrolled_grads)
    # Every layer's gradient is there and distinct: a scan that reused one layer's params would not be.
    q_grads = np.asarray(scanned_grads["layers"]["attention"]["q_proj"][...])
    assert q_grads.shape[0] == config.n_layers and all(np.abs(g).max() > 0 for g in q_grads)


@pytest.mark.parametrize("name", sorted(STACK_CONFIGS))
def test_scanned_layers_prefill_and_decode_like_the_unrolled_ones(name):
    """A prefill that keeps its last slot's logits, then one-token decode steps: same logits and caches."""
    config = STACK_CONFIGS[name]
    scanned, unrolled, params = _scanned_and_unrolled(config)
    tokens, mask, positions = _left_padded_batch(config)
    prompt_len, total, batch = 7, tokens.shape[1], tokens.shape[0]
    kv_mask = jnp.concatenate([mask, jnp.zeros((batch, 4), bool)], axis=1)
    step = jax.jit(forward, static_argnums=0, static_argnames="output_slots")

    def prefill_then_decode(graphdef, scan):
        cache = init_cache(config.replace(scan_layers=scan), batch, total + 4)
        assert cache.stacked == scan  # the scan carries one [L, ...] array; unrolled layers keep one each
        logits, cache = step(graphdef, params, tokens[:, :prompt_len], positions[:, :prompt_len], kv_mask, cache, 0,
                             output_slots=(prompt_len - 1, prompt_len))
        pieces = [logits]
        for i in range(prompt_len, total):
            logits, cache = step(graphdef, params, tokens[:, i:i + 1], positions[:, i:i + 1], kv_mask, cache, i)
            pieces.append(logits)
        return jnp.concatenate(pieces, axis=1), jnp.stack(cache.keys), jnp.stack(cache.values)

    scanned_logits, scanned_keys, scanned_values = prefill_then_decode(scanned, True)
    _assert_trees_close((scanned_logits, scanned_keys, scanned_values), prefill_then_decode(unrolled, False))
    assert scanned_keys.shape == (config.n_layers, batch, config.n_kv_heads, config.head_dim, total + 4)
    with pytest.raises(ValueError, match="stacked cache"):
        step(scanned, params, tokens[:, :1], positions[:, :1], kv_mask,
             init_cache(config.replace(scan_layers=False), batch, total + 4), 0)


def test_scan_layers_auto_scans_deep_stacks_on_accelerators_only():
    config = get_preset("qwen3-0.6b")
    assert config.scan_layers == "auto" and config.n_layers > UNROLLED_LAYERS_MAX
    assert not config.scans_layers("cpu") and config.scans_layers("tpu") and config.scans_layers("gpu")
    short = config.replace(n_layers=UNROLLED_LAYERS_MAX)  # quick to compile unrolled, and faster to run
    assert not short.scans_layers("tpu") and not short.scans_layers("gpu") and not short.scans_layers("cpu")
    assert short.replace(n_layers=UNROLLED_LAYERS_MAX + 1).scans_layers("tpu")
    assert get_preset("small").n_layers == UNROLLED_LAYERS_MAX and not get_preset("small").scans_layers("tpu")
    assert config.replace(scan_layers=True).scans_layers("cpu")
    assert not config.replace(scan_layers=False).scans_layers("tpu")
    with pytest.raises(ValueError, match="scan_layers"):
        config.replace(scan_layers="yes")


def test_building_a_model_lets_each_layers_copy_go_once_its_weight_is_stacked():
    """The decoder's layers are drawn one by one and stacked [L, ...]; each layer's own array is released
    as its weight is stacked, so what stays alive is the stacked weights alone (a model build peaks at the
    model plus one stacked weight, not twice the decoder), with the values the layers were drawn with."""
    from locojax.model.transformer import DecoderLayer, _stack_layers

    config = get_preset("tiny")
    layers = [DecoderLayer(config, nnx.Rngs(params=i)) for i in range(config.n_layers)]
    drawn = [jax.tree.map(np.asarray, nnx.state(layer)) for layer in layers]
    stacked = _stack_layers(layers)

    leftovers = [v for layer in layers for v in jax.tree.leaves(nnx.state(layer), is_leaf=lambda x: x is None)]
    assert all(v is None for v in leftovers), "a layer still holds its own copy"
    stacked_leaves = jax.tree.leaves(nnx.state(stacked))
    for index, layer_values in enumerate(drawn):
        before = jax.tree.leaves(layer_values)
        assert len(before) == len(stacked_leaves)
        for value, stacked_value in zip(before, stacked_leaves):
            np.testing.assert_array_equal(value, np.asarray(stacked_value)[index])


@pytest.mark.parametrize("tie", [True, False])
def test_building_the_layers_in_place_gives_the_stacked_models_values_bit_for_bit(monkeypatch, tie):
    """On accelerators the decoder is built in place, eagerly: each layer, as it is drawn, is written into
    the stacked weights (donated) and dropped, so the build peaks at the model plus one layer. Forced here
    on XLA:CPU, it gives the very model XLA:CPU's own build gives (one compiled program stacking the
    finished layers): every weight and adapter (drawn after the base, so the base is the same with or
    without LoRA), its axes, the same graph."""
    from locojax.model import LoRAConfig
    from locojax.model import transformer

    config = get_preset("tiny").replace(tie_embeddings=tie, lora=LoRAConfig(
        rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down")))
    stacked_build = create_model(config, seed=3)
    monkeypatch.setitem(transformer.BUILD_LAYERS_IN_PLACE, "cpu", True)
    writes = []
    real_write = transformer._write_layer
    monkeypatch.setattr(transformer, "_write_layer", lambda *a: writes.append(a[2]) or real_write(*a))
    in_place = create_model(config, seed=3)
    base_in_place = create_model(config.replace(lora=None), seed=3)
    assert [int(index) for index in writes] == 2 * list(range(config.n_layers))

    assert nnx.graphdef(in_place) == nnx.graphdef(stacked_build)
    expected = nnx.to_flat_state(nnx.state(stacked_build))
    built = nnx.to_flat_state(nnx.state(in_place))
    assert [path for path, _ in built] == [path for path, _ in expected]
    for (path, variable), (_, reference) in zip(built, expected):
        assert variable.get_metadata()["axes"] == reference.get_metadata()["axes"], path
        assert variable[...].dtype == reference[...].dtype, path
        np.testing.assert_array_equal(np.asarray(variable[...]), np.asarray(reference[...]), err_msg=str(path))
    base = dict(nnx.to_flat_state(nnx.state(base_in_place)))
    for path, variable in built:
        if "lora" not in path[-1]:
            np.testing.assert_array_equal(np.asarray(variable[...]), np.asarray(base[path][...]), err_msg=str(path))


@contextlib.contextmanager
def compilations():
    """The programs XLA compiles while the block runs (one entry each), from JAX's own monitoring events."""
    compiled: list[str] = []

    def count(name, *_, **__):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(name)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="accelerators draw the decoder eagerly, layer by layer")
def test_building_a_model_on_xla_cpu_compiles_one_program():
    """Every process that builds a model compiles what the build needs (a test run starts hundreds):
    drawn weight by weight, a tiny model's build compiled ~20 small programs; on XLA:CPU it is one. The
    shape here is one no other test builds, so nothing is served from JAX's in-memory caches; the seed
    is the program's argument, so a run of another seed reuses it."""
    config = get_preset("tiny").replace(d_model=40, d_ff=72, vocab_size=392)
    with compilations() as compiled:
        create_model(config, seed=11)
        assert len(compiled) == 1, compiled
        create_model(config, seed=12)  # the seed is the program's argument: another seed compiles nothing
    assert len(compiled) == 1, compiled


@pytest.mark.usefixtures("four_cpu_devices")
def test_a_model_drawn_onto_a_mesh_is_the_drawn_model_sharded_in_one_program():
    """`create_model(..., mesh=...)` (how a run builds its fresh policy) draws every weight and adapter
    straight into the place `shard_state` gives it: the same bits, shardings, axes and graph, in one
    compiled program on XLA:CPU, where placing the drawn weights compiled one more per weight shape."""
    from locojax.model import LoRAConfig

    config = get_preset("tiny").replace(d_model=48, d_ff=80, lora=LoRAConfig(
        rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down")))
    mesh = make_mesh(fsdp=2, tensor=2)
    with compilations() as compiled:
        placed = create_model(config, seed=5, mesh=mesh)
    drawn = create_model(config, seed=5)
    expected = nnx.to_flat_state(shard_state(nnx.state(drawn), mesh))
    built = nnx.to_flat_state(nnx.state(placed))
    assert nnx.graphdef(placed) == nnx.graphdef(drawn)
    assert [path for path, _ in built] == [path for path, _ in expected]
    for (path, variable), (_, reference) in zip(built, expected):
        assert variable.get_metadata()["axes"] == reference.get_metadata()["axes"], path
        assert variable[...].sharding == reference[...].sharding, path
        np.testing.assert_array_equal(np.asarray(variable[...]), np.asarray(reference[...]), err_msg=str(path))
    assert any(len(variable[...].sharding.device_set) == 4 for _, variable in built)
    if jax.default_backend() == "cpu":
        assert len(compiled) == 1, compiled


# Counted as the memory plan counts a TPU's programs (their peak beyond the arguments), this program held
# 105 MiB against 48 MiB of float32 weights on a v5e at f4e92159 (with LoRA: 48.6 MiB, one weights' worth),
# where temp_size_in_bytes had said 0 and the test passed without measuring anything. Not yet explained
# (layout copies of the weights for the backward's dots?); strict, so the day it holds there this fails.
@pytest.mark.xfail(jax.default_backend() == "tpu", strict=True,
                   reason="a v5e's compiled train step holds about a weights' worth of temporaries here (f4e92159)")
@pytest.mark.parametrize("lora", [False, True])
def test_a_scanned_forward_with_output_slots_keeps_no_second_copy_of_the_weights(lora):
    """Training scores the completion's slots only (`output_slots`). Cutting the last layer off the
    stacked weights to run it on those slots alone made XLA copy the other layers' weights into a
    temporary the size of the model, and its gradient a concatenation as large (Qwen3-4B with LoRA
    then did not fit one 16 GiB v5e at any rows). The compiled train step's temporaries stay well
    below the weights' size (float32: XLA:CPU converts bfloat16 weights to float32 for its dots,
    which would hide the copy in the conversion; TPUs do not)."""
    from locojax.model.config import LoRAConfig
    from locojax.model.transformer import split_adapters

    config = get_preset("small").replace(d_model=512, d_ff=1536, n_layers=4, n_heads=8, n_kv_heads=4,
                                         scan_layers=True, dtype="float32", param_dtype="float32")
    if lora:
        config = config.replace(lora=LoRAConfig(rank=8, alpha=16, targets=("q", "k", "v", "o", "gate", "up", "down")))
    abstract = nnx.eval_shape(lambda: create_model(config))
    graphdef, params = nnx.split(abstract)
    weight_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params["layers"]))
    batch, length = 4, 48
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, length), jnp.bool_)

    def loss(trained, frozen, tokens, mask):
        merged = nnx.merge_state(frozen, trained) if lora else trained
        positions = positions_from_mask(mask)
        logits = forward(graphdef, merged, tokens, positions, mask, output_slots=(16, length), remat="full")[0]
        return logits.mean()

    trained, frozen = (split_adapters(params)[::-1] if lora else (params, nnx.State({})))
    compiled = jax.jit(jax.grad(loss)).lower(trained, frozen, tokens, mask).compile()
    temporaries = program_temporaries(compiled.memory_analysis(), jax.devices()[0].platform)  # as the plan counts
    assert 0 < temporaries < 0.6 * weight_bytes, (temporaries / 2**20, weight_bytes / 2**20)


def test_remat_dots_keeps_the_matmul_outputs_so_its_backward_recomputes_no_matmul():
    """Compiled gradients of one scanned model under each policy: "dots" holds fewer temporaries than
    no remat (norms, rotary and attention scores are recomputed) but more than "full" (the weight
    matmuls' outputs are kept), and costs about no remat's FLOPs where "full" pays a second forward."""
    config = get_preset("small").replace(d_model=256, d_ff=768, n_layers=4, n_heads=4, n_kv_heads=2,
                                         scan_layers=True, dtype="float32", param_dtype="float32")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: create_model(config)))
    tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32)
    mask = jax.ShapeDtypeStruct((8, 64), jnp.bool_)
    temporaries, flops = {}, {}
    for remat in ("none", "dots", "full"):
        def loss(p, tokens, mask, remat=remat):
            positions = positions_from_mask(mask)
            return forward(graphdef, p, tokens, positions, mask, output_slots=(16, 64), remat=remat)[0].mean()

        compiled = jax.jit(jax.grad(loss)).lower(params, tokens, mask).compile()
        # As the memory plan counts them: a v5e's temp_size_in_bytes was 0 for all three programs (a46af8b).
        temporaries[remat] = program_temporaries(compiled.memory_analysis(), jax.devices()[0].platform)
        cost = compiled.cost_analysis()
        flops[remat] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert temporaries["full"] < temporaries["dots"] < 0.7 * temporaries["none"], temporaries
    assert flops["dots"] < 1.05 * flops["none"] < flops["full"], flops


def test_remat_policies_are_the_ones_the_spec_and_the_memory_plan_know():
    """A policy added to the model must be planned for and accepted by the spec (and the other way round)."""
    from typing import get_args

    from locojax.model.transformer import REMAT_POLICIES
    from locojax.placement.memory import REMAT_POLICIES as PLANNED
    from locojax.spec import ModelSpec

    assert tuple(REMAT_POLICIES) == PLANNED
    assert get_args(ModelSpec.model_fields["remat"].annotation) == PLANNED
