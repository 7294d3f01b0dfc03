"""LoRA: the spec's checks, adapters that start as the base model, adapter-only training state, the base
model as KL reference, checkpoints of adapters alone, and exports that `transformers` and `peft` read."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from locojax.checkpoint import Checkpointer
from locojax.model import LoRAConfig, create_model, get_preset, lora_param_count, positions_from_mask
from locojax.model.hf import load_hf_checkpoint, load_peft_adapter, save_hf_checkpoint, save_peft_adapter
from locojax.model.transformer import LoRAParam, adapters_off, fold_adapters_for_rollout, split_adapters
from locojax.spec import SpecError, parse_spec
from locojax.train import (
    init_train_state,
    make_optimizer,
    make_train_step,
    model_params,
    sequence_logprobs,
    split_params,
)
from locojax.spec import AlgoSpec, OptimSpec

ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
LORA = LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS)


def _tokens(batch=3, length=12, seed=1):
    ids = jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, 300)
    mask = np.ones((batch, length), bool)
    mask[0, :5] = False  # left padding
    return ids, jnp.asarray(mask)


def _logits(model, ids, mask):
    return np.asarray(model(ids, positions_from_mask(mask), mask)[0])


def _moved_adapters(model, seed=3):
    """The model with every adapter (B too) set to random values, as if trained."""
    graphdef, params = split_params(model)
    frozen, adapters = split_adapters(params)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
    return nnx.merge(graphdef, nnx.merge_state(frozen, adapters))


# ------------------------------------------------------------------------------------------------
# The spec


@pytest.mark.parametrize("lora,field,message", [
    ({"targets": ["q", "v", "x"]}, "model.lora.targets[2]", "unknown target 'x' (one of q, k, v, o, gate, up, down)"),
    ({"rank": 0}, "model.lora.rank", "greater than or equal to 1"),
    ({"rank": 2.5}, "model.lora.rank", "valid integer"),
    ({"alpha": 0}, "model.lora.alpha", "greater than 0"),
    ({"targets": []}, "model.lora.targets", "at least 1"),
    ({"targets": ["q", "q"]}, "model.lora.targets", "'q' is listed twice"),
    ({"ranks": 4}, "model.lora.ranks", "Extra inputs"),
])
def test_spec_rejects_bad_lora_naming_the_field(lora, field, message):
    with pytest.raises(SpecError) as error:
        parse_spec({"model": {"lora": lora}})
    assert f"{field}: " in str(error.value) and message in str(error.value), str(error.value)


def test_spec_lora_defaults_and_off_by_default():
    assert parse_spec({}).model.lora is None
    lora = parse_spec({"model": {"lora": {"rank": 2, "alpha": 4, "targets": ["q", "down"]}}}).model.lora
    assert (lora.rank, lora.alpha, lora.targets, lora.init_from) == (2, 4.0, ["q", "down"], None)


# ------------------------------------------------------------------------------------------------
# The model


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_fresh_adapters_give_the_base_model_bit_for_bit(scan):
    config = get_preset("tiny").replace(scan_layers=scan)
    base, adapted = create_model(config, seed=0), create_model(config.replace(lora=LORA), seed=0)
    ids, mask = _tokens()
    assert np.array_equal(_logits(base, ids, mask), _logits(adapted, ids, mask))
    # The base weights are the same draws with or without adapters; B starts at zero.
    frozen, adapters = split_adapters(split_params(adapted)[1])
    for a, b in zip(jax.tree.leaves(split_params(base)[1]), jax.tree.leaves(frozen), strict=True):
        assert np.array_equal(a, b)
    assert all(not np.any(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(adapters)
               if "lora_b" in jax.tree_util.keystr(path))
    assert sum(leaf.size for leaf in jax.tree.leaves(adapters)) == lora_param_count(config.replace(lora=LORA))


def test_adapters_change_the_output_and_scanned_equals_unrolled():
    config = get_preset("tiny").replace(lora=LORA)
    unrolled = _moved_adapters(create_model(config.replace(scan_layers=False), seed=0))
    scanned = _moved_adapters(create_model(config.replace(scan_layers=True), seed=0))
    base = create_model(get_preset("tiny"), seed=0)
    ids, mask = _tokens()
    moved = _logits(unrolled, ids, mask)
    assert np.abs(moved - _logits(base, ids, mask)).max() > 1e-3
    np.testing.assert_allclose(moved, _logits(scanned, ids, mask), atol=2e-5)


# ------------------------------------------------------------------------------------------------
# Training


def _grpo_batch(batch=4, prompt_len=6, new_len=5, seed=2):
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((batch, prompt_len), bool)
    prompt_mask[0, :2] = False
    completion_mask = np.ones((batch, new_len), bool)
    completion_mask[1, 3:] = False
    tokens = rng.integers(0, 300, (batch, prompt_len + new_len)).astype(np.int32)
    return {"tokens": tokens, "prompt_mask": prompt_mask, "completion_mask": completion_mask,
            "old_logprobs": np.full((batch, new_len), -5.0, np.float32),
            "advantages": np.array([1.0, -1.0, 0.5, -0.5], np.float32)}


def test_only_adapters_get_gradients_and_optimizer_state():
    model = create_model(get_preset("tiny").replace(lora=LORA), seed=0)
    graphdef, params = split_params(model)
    frozen_before = jax.tree.map(np.asarray, split_adapters(params)[0])
    optimizer = make_optimizer(OptimSpec(lr=1e-2, warmup_steps=0, weight_decay=0.1), total_steps=4)
    state = init_train_state(params, optimizer, lora=True)
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(state.params))
    assert all(isinstance(v, LoRAParam) for v in jax.tree.leaves(
        state.params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    # AdamW's two moments per adapter, nothing else array-shaped (the frozen weights have none).
    moment_shapes = sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    assert moment_shapes == sorted(adapter_shapes * 2)
    step = make_train_step(graphdef, optimizer, AlgoSpec(kl_coef=0.0))
    batch = _grpo_batch()
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step(state, batch)
    state, metrics = step(state, batch)
    assert float(metrics["policy/grad_norm"]) > 0
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
    assert all(moved), "every adapter (A and B) moves after two steps"
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(state.frozen), strict=True):
        assert np.array_equal(a, b)


def test_kl_reference_is_the_base_model_sharing_the_frozen_weights():
    config = get_preset("tiny").replace(lora=LORA)
    base = create_model(get_preset("tiny"), seed=0)
    graphdef, params = split_params(_moved_adapters(create_model(config, seed=0)))
    optimizer = make_optimizer(OptimSpec(lr=1e-2, warmup_steps=0), total_steps=4)
    state = init_train_state(params, optimizer, lora=True)
    reference = model_params(adapters_off(state.params), state.frozen)
    # No second copy of the weights: the reference's base leaves are the state's frozen arrays themselves.
    frozen_ids = {id(x) for x in jax.tree.leaves(state.frozen)}
    reference_frozen, reference_adapters = split_adapters(reference)
    assert {id(x) for x in jax.tree.leaves(reference_frozen)} == frozen_ids
    assert all(not np.any(x) for x in jax.tree.leaves(reference_adapters))
    batch = _grpo_batch()
    args = (batch["tokens"], batch["prompt_mask"], batch["completion_mask"])
    base_graphdef, base_params = split_params(base)
    expected = sequence_logprobs(base_graphdef, base_params, *args)
    np.testing.assert_array_equal(sequence_logprobs(graphdef, reference, *args), expected)
    assert np.abs(np.asarray(sequence_logprobs(graphdef, state.model_params, *args) - expected)).max() > 1e-4
    # The KL term runs with that reference and leaves the frozen weights untouched (not donated).
    step = make_train_step(graphdef, optimizer, AlgoSpec(kl_coef=0.1))
    ref_batch = {**batch, "ref_logprobs": np.asarray(expected)}
    state, metrics = step(state, ref_batch)
    assert float(metrics["loss/kl"]) > 0
    assert np.array_equal(sequence_logprobs(graphdef, reference, *args), expected)


# ------------------------------------------------------------------------------------------------
# Rollout with the adapters folded in ("merged")


def test_folding_adapters_for_rollout_gives_the_adapted_weights_and_a_graph_without_adapters():
    merged_config = get_preset("tiny").replace(lora=LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS,
                                                               rollout="merged"))
    graphdef, params = split_params(_moved_adapters(create_model(merged_config, seed=0)))
    folded_graphdef, folded = fold_adapters_for_rollout(graphdef, params)
    assert not jax.tree.leaves(nnx.state(nnx.merge(folded_graphdef, folded), LoRAParam))
    flat, flat_folded = nnx.to_flat_state(params), dict(nnx.to_flat_state(folded))
    layers = merged_config.n_layers
    for path, variable in flat:
        if "_lora_" in str(path[-1]):
            assert path not in flat_folded
            continue
        name = str(path[-1])
        target = name.removesuffix("_proj")
        if target not in ALL_TARGETS:  # norms, embedding: untouched
            assert np.array_equal(np.asarray(flat_folded[path][...]), np.asarray(variable[...])), path
            continue
        module = dict(flat)
        a = np.asarray(module[(*path[:-1], f"{target}_lora_a")][...], np.float64)  # [L, r, in]
        b = np.asarray(module[(*path[:-1], f"{target}_lora_b")][...], np.float64)  # [L, out, r]
        expected = np.asarray(variable[...], np.float64) + (LORA.scale * b @ a).reshape(variable[...].shape)
        assert variable[...].shape[0] == layers
        np.testing.assert_allclose(np.asarray(flat_folded[path][...]), expected, rtol=1e-6, atol=1e-7)
    # "adapters" (the default) leaves the model as it is.
    plain_graphdef, plain = split_params(_moved_adapters(create_model(get_preset("tiny").replace(lora=LORA), seed=0)))
    assert fold_adapters_for_rollout(plain_graphdef, plain) == (plain_graphdef, plain)


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "trained"])
def test_a_merged_rollout_samples_what_the_adapter_rollout_samples(trained):
    """The same tokens and (to float32 rounding) log-probs, sampled at temperature 1 from the same keys;
    fresh adapters (B = 0) fold in exactly, so step 0's rollout is the base model's either way."""
    from locojax.rollout import SamplingConfig, make_generate_fn

    results = {}
    for rollout in ("adapters", "merged"):
        config = get_preset("tiny").replace(lora=LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS, rollout=rollout))
        model = create_model(config, seed=0)
        graphdef, params = split_params(_moved_adapters(model) if trained else model)
        sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, eos_id=None, pad_id=0)
        ids, mask = _tokens(batch=4, length=8)
        generate = make_generate_fn(config, graphdef, sampling, 8, 4)
        results[rollout] = generate(params, np.asarray(ids), np.asarray(mask), jax.random.PRNGKey(5))
    adapters, merged = results["adapters"], results["merged"]
    assert np.array_equal(np.asarray(adapters.tokens), np.asarray(merged.tokens))
    if trained:
        np.testing.assert_allclose(np.asarray(merged.logprobs), np.asarray(adapters.logprobs), atol=1e-5)
    else:
        assert np.array_equal(np.asarray(merged.logprobs), np.asarray(adapters.logprobs))


def test_memory_plan_counts_the_merged_rollout_copy_of_the_adapted_weights():
    from locojax.placement.memory import plan_memory

    config = get_preset("qwen3-0.6b").replace(param_dtype="bfloat16", dtype="bfloat16")
    plans = {rollout: plan_memory(config.replace(lora=LoRAConfig(16, 32.0, ALL_TARGETS, rollout)), rows_per_host=16,
                                  prompt_len=96, new_len=256, remat="full")
             for rollout in ("adapters", "merged")}
    d, f, hd = config.d_model, config.d_ff, config.head_dim
    adapted = config.n_layers * 2 * (d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2 + 3 * d * f)
    assert "merged_weights" not in plans["adapters"].rollout
    assert plans["merged"].rollout["merged_weights"] == adapted
    assert plans["merged"].rollout == {**plans["adapters"].rollout, "merged_weights": adapted}


def test_a_merged_rollout_that_does_not_fit_is_refused_naming_the_adapter_rollout_as_what_would_fit():
    """Qwen3-0.6B bf16, 64 rows in micro-batches of 8, where the rollout's KV cache binds: the merged copy of
    the adapted weights (0.82 GiB) tips it over a 4.6 GiB device; the refusal names the term and
    `lora.rollout: adapters` as what would fit, which does. An adapter rollout is never told to switch."""
    import dataclasses

    from locojax.placement.memory import GiB, plan_memory, refusal

    config = get_preset("qwen3-0.6b").replace(param_dtype="bfloat16", dtype="bfloat16")
    shape = dict(rows_per_host=64, prompt_len=96, new_len=256, remat="full", micro_batches=8,
                 capacity_bytes=4.6 * GiB)
    merged = plan_memory(config.replace(lora=LoRAConfig(16, 32.0, ALL_TARGETS, "merged")), **shape)
    adapters = plan_memory(config.replace(lora=LoRAConfig(16, 32.0, ALL_TARGETS)), **shape)
    assert adapters.fits and not merged.fits
    message = refusal(merged)
    assert "model.lora.rollout: adapters" in message and "merged_weights" in message, message
    assert "model.lora.rollout" not in refusal(dataclasses.replace(adapters, capacity_bytes=1 * GiB))


# ------------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_holds_adapters_alone_and_resumes_exactly(tmp_path):
    config = get_preset("tiny").replace(lora=LORA)
    graphdef, params = split_params(create_model(config, seed=0))
    optimizer = make_optimizer(OptimSpec(lr=1e-2, warmup_steps=0), total_steps=6)
    step = make_train_step(graphdef, optimizer, AlgoSpec())
    batches = [_grpo_batch(seed=s) for s in range(4)]
    state = init_train_state(params, optimizer, lora=True)
    with Checkpointer(tmp_path / "ckpt", every=2) as checkpoints:
        for batch in batches[:2]:
            state, _ = step(state, batch)
        checkpoints.save(state)
        checkpoints.wait_until_finished()
        saved_bytes = checkpoints.step_bytes(2)
    straight = state
    for batch in batches[2:]:
        straight, _ = step(straight, batch)
    # Resume into a fresh state (same spec: same frozen base) and continue with the same batches.
    fresh = init_train_state(split_params(create_model(config, seed=0))[1], optimizer, lora=True)
    with Checkpointer(tmp_path / "ckpt", every=2) as checkpoints:
        resumed, _ = checkpoints.restore_latest(fresh)
    assert int(resumed.step) == 2
    for batch in batches[2:]:
        resumed, _ = step(resumed, batch)
    for a, b in zip(jax.tree.leaves((straight.params, straight.opt_state)),
                    jax.tree.leaves((resumed.params, resumed.opt_state)), strict=True):
        assert np.array_equal(a, b)
    # Adapters + two AdamW moments in float32 (plus Orbax's metadata): less than the frozen weights' own
    # bytes, which any checkpoint holding them would need at least once (random floats do not compress).
    adapter_bytes = 4 * lora_param_count(config)
    frozen_bytes = sum(x.nbytes for x in jax.tree.leaves(state.frozen))
    assert 3 * adapter_bytes <= saved_bytes < frozen_bytes, (saved_bytes, frozen_bytes)


# ------------------------------------------------------------------------------------------------
# Export


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _torch_inputs():
    ids, mask = _tokens()
    mask_np = np.asarray(mask)
    positions = np.maximum(np.cumsum(mask_np, -1) - 1, 0)
    return ids, mask, torch.tensor(np.asarray(ids)), torch.tensor(mask_np.astype(np.int64)), torch.tensor(positions)


def test_merged_export_and_peft_adapter_match_the_adapter_model(tmp_path):
    peft = pytest.importorskip("peft")
    targets = ("q", "v", "o", "up", "down")
    config = get_preset("tiny").replace(tie_embeddings=False, lora=LoRAConfig(rank=4, alpha=8.0, targets=targets))
    model = _moved_adapters(create_model(config, seed=0))
    ids, mask, ids_t, mask_t, positions_t = _torch_inputs()
    ours = _logits(model, ids, mask)
    real = np.asarray(mask)

    save_hf_checkpoint(model, tmp_path / "merged")
    merged = load_hf_checkpoint(tmp_path / "merged")
    assert merged.config.lora is None
    assert np.abs(_logits(merged, ids, mask) - ours)[real].max() <= 1e-5
    reference = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        merged_hf = reference(input_ids=ids_t, attention_mask=mask_t, position_ids=positions_t).logits.numpy()
    assert np.abs(merged_hf - ours)[real].max() <= 1e-4

    # The base alone (adapters off) in HF form, and the adapters as PEFT reads them.
    graphdef, params = split_params(model)
    frozen, adapters = split_adapters(params)
    save_hf_checkpoint(nnx.merge(graphdef, nnx.merge_state(frozen, adapters_off(adapters))), tmp_path / "base")
    save_peft_adapter(model, tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8.0)
    from safetensors.numpy import load_file

    names = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    a = names["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = names["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (4, config.d_model) and b.shape == (config.n_heads * config.head_dim, 4)
    assert len(names) == 2 * len(targets) * config.n_layers

    base_hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "base").eval()
    with_adapter = peft.PeftModel.from_pretrained(base_hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        peft_logits = with_adapter(input_ids=ids_t, attention_mask=mask_t, position_ids=positions_t).logits.numpy()
    assert np.abs(peft_logits - ours)[real].max() <= 1e-4

    # Loading the adapter back (a spec's model.lora.init_from) restores the adapter model exactly.
    fresh = create_model(config, seed=5)
    nnx.update(fresh, nnx.state(load_hf_checkpoint(tmp_path / "base"), nnx.Param))
    loaded = load_peft_adapter(tmp_path / "adapter", fresh)
    assert np.array_equal(_logits(loaded, ids, mask), ours)
    wrong_rank = create_model(config.replace(lora=LoRAConfig(rank=2, alpha=8.0, targets=targets)), seed=0)
    with pytest.raises(ValueError, match="r is 4, the spec's model.lora gives 2"):
        load_peft_adapter(tmp_path / "adapter", wrong_rank)


# ------------------------------------------------------------------------------------------------
# Runs: CO GRPO with a KL term, SFT with its exports, GRPO from a saved adapter, DA's weight sync


LORA_SPEC = {"rank": 4, "alpha": 8.0, "targets": list(ALL_TARGETS)}


def _adapters_of(spec):
    from locojax.policy import load_policy

    return split_adapters(load_policy(spec).params)


@pytest.mark.slow
@pytest.mark.usefixtures("test_rewards_allowed")
def test_co_lora_run_with_kl_resumes_exactly_and_checkpoints_adapters_alone(tmp_path):
    from locojax.checkpoint import load_params
    from locojax.metrics import read_jsonl
    from locojax.modes.co import run_co
    from tests.locojax.test_co import tiny_spec

    def spec(name, steps):
        return parse_spec({**tiny_spec(tmp_path, name, steps=steps, checkpoint={"every": 1, "keep": 3}),
                           "model": {"preset": "tiny", "lora": LORA_SPEC}, "algo": {"kl_coef": 0.5}})

    straight = run_co(spec("straight", 2), console=False)
    run_co(spec("resumed", 1), console=False)
    resumed = run_co(spec("resumed", 2), resume=True, console=False)
    assert (straight.steps_done, resumed.steps_done) == (2, 2)
    frozen, adapters = _adapters_of(spec("straight", 2))
    after = [load_params(tmp_path / name / "checkpoints", adapters, 2) for name in ("straight", "resumed")]
    for a, b in zip(jax.tree.leaves(after[0]), jax.tree.leaves(after[1]), strict=True):
        assert np.array_equal(a, b)
    assert any(np.any(np.asarray(x)) for path, x in jax.tree_util.tree_leaves_with_path(after[0])
               if "lora_b" in jax.tree_util.keystr(path)), "training moved B off zero"
    rows = [r for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl") if r["host"] == "all"]
    # Step 0's policy is the base model itself, i.e. the reference; step 1's has moved away from it.
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-7) and rows[1]["loss/kl"] > 0
    result = json.loads((tmp_path / "straight" / "result.json").read_text())
    on_disk = sum(f.stat().st_size for f in (tmp_path / "straight" / "checkpoints" / "2").rglob("*") if f.is_file())
    assert result["checkpoint_bytes"] == on_disk
    # Adapters and two moments at least; a checkpoint of every weight would hold 3x the frozen bytes alone.
    frozen_bytes = sum(x.nbytes for x in jax.tree.leaves(frozen))
    assert 3 * 4 * lora_param_count(get_preset("tiny").replace(lora=LORA)) <= on_disk < 3 * frozen_bytes

    # `locojax export`'s work: the run's checkpoint beside the spec's base, written merged and as PEFT.
    from locojax.commands import restore_trained_params
    from locojax.modes.sft import export_policy
    from locojax.policy import load_policy

    policy = load_policy(spec("straight", 2))
    restore_trained_params(spec("straight", 2), policy, tmp_path / "straight")
    trained = nnx.merge(policy.graphdef, policy.params)
    written = export_policy(trained, tmp_path / "exported")
    assert [p.name for p in written] == ["model", "adapter"]
    ids, mask = _tokens()
    merged = _logits(load_hf_checkpoint(tmp_path / "exported" / "model"), ids, mask)
    assert np.abs(merged - _logits(trained, ids, mask))[np.asarray(mask)].max() <= 1e-5


@pytest.mark.slow
def test_sft_lora_exports_merged_model_and_adapter_and_grpo_starts_from_it(tmp_path):
    from locojax.modes.sft import run_sft
    from tests.locojax.test_sft import sft_spec

    spec = parse_spec(sft_spec(tmp_path, steps=2, model={"preset": "tiny", "lora": LORA_SPEC}))
    assert run_sft(spec, console=False).status == "succeeded"
    out = tmp_path / "sft"
    from locojax.checkpoint import load_params

    frozen, adapters = _adapters_of(spec)
    trained = nnx.merge_state(frozen, load_params(out / "checkpoints", adapters, 2))
    from locojax.policy import load_policy

    graphdef = load_policy(spec).graphdef
    ids, mask = _tokens()
    expected = _logits(nnx.merge(graphdef, trained), ids, mask)
    assert np.abs(_logits(load_hf_checkpoint(out / "model"), ids, mask) - expected)[np.asarray(mask)].max() <= 1e-5
    # A GRPO spec on the same base starts from the saved adapter: exactly the trained model.
    grpo = parse_spec({**sft_spec(tmp_path, "grpo"), "kind": "grpo",
                       "model": {"preset": "tiny", "lora": {**LORA_SPEC, "init_from": str(out / "adapter")}}})
    started = load_policy(grpo)
    for a, b in zip(jax.tree.leaves(started.params), jax.tree.leaves(trained), strict=True):
        assert np.array_equal(a, b)
    # Fresh adapters on the merged export (model.checkpoint + model.lora) start as that model exactly.
    on_merged = parse_spec({**sft_spec(tmp_path, "grpo"), "kind": "grpo",
                            "model": {"preset": "tiny", "checkpoint": str(out / "model"), "lora": LORA_SPEC}})
    policy = load_policy(on_merged)
    assert policy.config.lora is not None
    assert np.array_equal(_logits(nnx.merge(policy.graphdef, policy.params), ids, mask),
                          _logits(load_hf_checkpoint(out / "model"), ids, mask))


@pytest.mark.multiprocess
def test_da_pushes_the_adapters_alone_and_rollout_samples_with_them(tmp_path):
    from locojax.metrics import read_jsonl
    from tests.locojax.test_co import locojax, tiny_spec, write_spec

    spec = {**tiny_spec(tmp_path, "da", steps=4, placement={"mode": "da", "hosts": 2, "rollout_fraction": 0.5}),
            "model": {"preset": "tiny", "lora": LORA_SPEC}, "debug": {"checksum_every": 1}}
    done = locojax("train", str(write_spec(tmp_path, spec)), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "da" / "metrics.jsonl") if r["host"] == "all"}
    assert sorted(rows) == [0, 1, 2, 3]
    adapter_bytes = 4 * lora_param_count(get_preset("tiny").replace(lora=LORA))
    synced = [rows[s]["da/weight_sync_bytes"] for s in range(3)]
    assert synced == [adapter_bytes] * 3  # every push after a train step: adapters, not the 0.1 M weights
    # Batch s >= 2 was sampled with the adapters train step s-2 produced (the checksums cover the adapters).
    for s in (2, 3):
        assert rows[s]["da/rollout_checksum"] == rows[s - 2]["params/checksum"]
    assert len({rows[s]["params/checksum"] for s in range(4)}) == 4


def test_cost_model_syncs_and_all_reduces_adapter_bytes_under_lora():
    from locojax.placement.cost_model import ModelSize, Placement, estimate_step, weight_sync_terms
    from locojax.placement.hardware import HARDWARE
    from locojax.placement.workloads import WORKLOADS

    hardware = HARDWARE.get("tpu-v5e")
    config = get_preset("qwen3-0.6b")
    adapted = config.replace(lora=LoRAConfig(rank=16, alpha=32.0, targets=ALL_TARGETS))
    full, lora = ModelSize.from_config(config), ModelSize.from_config(adapted)
    assert lora.params == full.params and lora.trained_bytes(2) == 4 * lora_param_count(adapted)
    assert weight_sync_terms(lora, hardware, 4).network["dcn_s_per_byte"] == 4 * lora_param_count(adapted)
    assert weight_sync_terms(full, hardware, 4).network["dcn_s_per_byte"] == 2 * full.params
    workload = WORKLOADS.get(WORKLOADS.names()[0])
    placement = Placement("da", 16, 4, rollout_fraction=0.5)
    full_sync = estimate_step(config, hardware, workload, placement).breakdown["weight_sync"]
    lora_sync = estimate_step(adapted, hardware, workload, placement).breakdown["weight_sync"]
    assert lora_sync < full_sync
