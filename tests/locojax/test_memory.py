"""The memory plan (no allocation), the refusal before allocation, chunked completion-only log-probs,
remat, bfloat16, and FSDP x tensor training equal to pure data parallelism.

The real Qwen3-0.6B run lives in bench/scale.py, not here."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from locojax import metrics as m
from locojax.model import get_preset, param_count
from locojax.modes import common
from locojax.placement.memory import (
    GiB,
    MemoryPlanError,
    MeshShape,
    fit_plan,
    plan_memory,
)
from locojax.spec import AlgoSpec, parse_spec
from locojax.train import (
    Optimizer,
    chunked_logprobs_and_entropy,
    completion_logprobs_and_entropy,
    init_train_state,
    make_optimizer,
    make_train_step,
    split_params,
)

FAST_COMPILE = {"xla_backend_optimization_level": 0}
ALGO = AlgoSpec(name="grpo", kl_coef=0.0)


def _plan(name, **changes):
    shape = dict(rows_per_host=16, prompt_len=128, new_len=32)
    shape.update(changes)
    return plan_memory(get_preset(name), **shape)


def test_plan_terms_follow_the_parameter_count_for_0_6b_8b_32b():
    for name in ("qwen3-0.6b", "qwen3-8b", "qwen3-32b"):
        params = param_count(get_preset(name))
        plan = _plan(name, kl_reference=True)
        assert plan.persistent["params"] == params * 4
        assert plan.persistent["optimizer"] == params * 8  # AdamW's two moments
        assert plan.persistent["reference"] == params * 4
        config = get_preset(name)
        embedding = config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
        # Gradients, AdamW's update and the backward's buffers (factors measured on XLA's buffer assignment).
        assert plan.train["gradients"] == pytest.approx((1.5 * embedding + 4.25 * (params - embedding)) * 4)
        # bfloat16 halves every parameter-sized term; fsdp 4 quarters the sharded ones.
        half = _plan(name, dtype="bfloat16")
        assert half.persistent["params"] == params * 2
        sharded = _plan(name, mesh=MeshShape(1, 4, 1))
        assert sharded.persistent["params"] == params
        assert sharded.persistent["rollout_params"] == params * 4  # rollout decodes from a whole copy
    # 0.6B float32 at 16 rows under remat: params and moments (6.7 GiB), the step's gradient-sized
    # buffers (7.8 GiB) and activations; without remat the activations alone are ~7 GiB more.
    small = _plan("qwen3-0.6b", remat="full")
    assert 14 * GiB < small.peak_bytes < 16 * GiB
    assert _plan("qwen3-0.6b").peak_bytes > small.peak_bytes + 5 * GiB
    # Remat keeps one activation per layer: far less than every layer's.
    full = _plan("qwen3-0.6b", remat="full", rows_per_host=64)
    none = _plan("qwen3-0.6b", remat="none", rows_per_host=64)
    assert full.train["activations"] < none.train["activations"] / 5
    # Keeping the weight matmuls' outputs sits between the two: it keeps less than every activation
    # (no norms, rotary or float32 attention scores) but far more than one per layer.
    dots = _plan("qwen3-0.6b", remat="dots", rows_per_host=64)
    assert 3 * full.train["activations"] < dots.train["activations"] < none.train["activations"]
    # The KV cache: 2 x 4 bytes x 8 kv heads x 128 x 28 layers per token.
    assert small.rollout["kv_cache"] == 16 * 160 * 2 * 4 * 8 * 128 * 28


def test_fit_plan_needs_fsdp_for_8b_on_v5p_and_refuses_32b_naming_the_term():
    v5p = 95 * GiB
    plan = fit_plan(get_preset("qwen3-8b"), devices_per_host=4, capacity_bytes=v5p, capacity_name="HBM",
                    dtypes=("float32",), rows_per_host=16, prompt_len=128, new_len=256)
    assert plan.mesh.param_shards > 1 and plan.fits
    with pytest.raises(MemoryPlanError, match=r"largest term being (params|optimizer|gradients|rollout_params)"):
        fit_plan(get_preset("qwen3-32b"), devices_per_host=4, capacity_bytes=v5p, capacity_name="HBM",
                 dtypes=("float32",), rows_per_host=64, prompt_len=128, new_len=256)


def test_the_mesh_must_divide_the_host_naming_the_fields():
    from locojax.spec import SpecError

    with pytest.raises(SpecError, match=r"placement.*fsdp x placement.tensor \(2 x 2\) must divide"):
        parse_spec({"placement": {"devices_per_host": 2, "fsdp": 2, "tensor": 2}})
    assert parse_spec({"placement": {"devices_per_host": 8, "fsdp": 2, "tensor": 2}}).placement.fsdp == 2


def test_a_run_that_cannot_fit_is_refused_before_any_parameter_exists(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(common, "load_policy", lambda spec: loaded.append(spec))
    spec = parse_spec({"name": "big", "model": {"preset": "qwen3-32b"},
                       "rollout": {"prompts_per_step": 4, "group_size": 4}})
    with pytest.raises(MemoryPlanError) as refused:
        common.prepare_trainer(spec, jax.devices()[:1], tmp_path, False)
    message = str(refused.value)
    assert "does not fit" in message and "largest term is" in message
    assert "placement.fsdp" in message and "model.dtype: bfloat16" in message
    assert loaded == []  # refused before the policy (or anything else) was built


def _compile_names(caplog) -> list[str]:
    """The functions XLA compiled so far, from JAX's compile log (`jax_log_compiles`)."""
    return [record.getMessage().split(" of ")[1].split(" in ")[0] for record in caplog.records
            if "Finished XLA compilation" in record.getMessage()]


@pytest.mark.slow
@pytest.mark.parametrize("lora,placement", [
    (False, {}), (True, {}), (False, {"early_forward": True}),
    (True, {"devices_per_host": 4, "fsdp": 4}), (False, {"devices_per_host": 4, "fsdp": 4, "early_forward": True}),
], ids=["full", "lora", "early-forward", "lora-fsdp", "early-forward-fsdp"])
def test_the_compiled_plan_compiles_the_programs_the_run_then_calls(tmp_path, monkeypatch, caplog, capfd, lora,
                                                                     placement):
    """On accelerators the plan comes from XLA's memory analysis of the run's own train step, rollout and
    KL reference pass, compiled from abstract shapes before any parameter exists; the run's steps then
    compile none of them again. Run here on CPU by asking for the compiled plan on this platform. With
    LoRA the plan counts the frozen weights once, and the reference as its zeroed adapters alone. The
    train step is one program, or with placement.early_forward the early forward's two. Under FSDP the
    train step's new state keeps the old one's layout: XLA had sharded LoRA's A matrices it was given
    replicated, and step 1 compiled everything again."""
    from locojax.modes.co import COSession, run_co

    monkeypatch.setattr(common, "plans_by_compiling", lambda platform: True)
    model = {"preset": "tiny", **({"lora": {"rank": 4, "alpha": 8.0}} if lora else {})}
    early = placement.get("early_forward", False)
    # Shapes of their own for the early-forward runs, so their rollout is not one an earlier case compiled.
    spec = parse_spec({"name": "compiled", "model": model, "task": {"name": "arith"},
                       "rollout": {"prompts_per_step": 4, "group_size": 4, "max_prompt_tokens": 32,
                                   "max_new_tokens": 6 if early else 8},
                       "algo": {"kl_coef": 0.05}, "steps": 3, "checkpoint": {"every": 0},
                       "placement": placement, "output_dir": str(tmp_path / "run")})
    set_up_at = []
    real_init = COSession.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        set_up_at.append(len(_compile_names(caplog)))

    monkeypatch.setattr(COSession, "__init__", init)
    jax.config.update("jax_log_compiles", True)
    caplog.set_level("WARNING", logger="jax")
    try:
        result = run_co(spec, console=False)
    finally:
        jax.config.update("jax_log_compiles", False)
    assert result.status == "succeeded"
    # time/setup names its parts: here the programs compile in setup, so their time is there.
    first = next(r for r in m.read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["host"] == m.ALL_HOSTS)
    assert first[m.TIME_SETUP_COMPILE] > 0 and first[m.TIME_SETUP_MODEL] > 0
    assert sum(first[name] for name in m.SETUP_PARTS) <= first[m.TIME_SETUP]
    names = _compile_names(caplog)
    during_setup, during_steps = names[:set_up_at[0]], names[set_up_at[0]:]
    train = ("jit(forward)", "jit(update)") if early else ("jit(train_step)",)
    for program in (*train, "jit(_generate)", "jit(<lambda>)"):  # <lambda>: the reference pass
        assert program in during_setup and program not in during_steps, (during_setup, during_steps)
    plan_lines = [line for line in caplog.text.splitlines() if "memory plan per device" in line]
    assert not plan_lines  # printed to stderr, not logged
    summary = next(line for line in capfd.readouterr().err.splitlines() if "memory plan per device" in line)
    persistent = summary.split("persistent [")[1].split("]")[0]
    if lora:  # the tiny model's 0.38 MiB of weights once; adapters (q, k, v, o at rank 4) 0.02 MiB
        assert persistent.startswith("frozen 0.00, adapters 0.00, optimizer 0.00") and "reference 0.00" in persistent
    else:
        assert persistent.startswith("params 0.00, optimizer 0.00") and "frozen" not in persistent


def _lora_config(name, rank=8, **changes):
    from locojax.model import LoRAConfig

    targets = ("q", "k", "v", "o", "gate", "up", "down")
    return get_preset(name).replace(lora=LoRAConfig(rank=rank, alpha=2.0 * rank, targets=targets), **changes)


def test_lora_plan_trains_adapters_alone_and_counts_the_frozen_weights_once():
    from locojax.model import lora_param_count

    shape = dict(rows_per_host=16, prompt_len=128, new_len=32, kl_reference=True)
    full = plan_memory(get_preset("qwen3-8b"), dtype="bfloat16", **shape)
    lora = plan_memory(_lora_config("qwen3-8b", rank=16), dtype="bfloat16", **shape)
    adapter_bytes = 4 * lora_param_count(_lora_config("qwen3-8b", rank=16))
    assert lora.persistent["params"] == full.persistent["params"] == 2 * param_count(get_preset("qwen3-8b"))
    assert lora.persistent["adapters"] == adapter_bytes and lora.persistent["optimizer"] == 2 * adapter_bytes
    assert lora.persistent["reference"] == adapter_bytes  # not a second copy of the weights
    assert lora.train["gradients"] < full.train["gradients"] / 2
    assert lora.train["activations"] == full.train["activations"]
    assert lora.peak_bytes < full.peak_bytes - 3 * 2 * param_count(get_preset("qwen3-8b"))


def test_lora_train_step_temporaries_match_the_plan_on_cpu(lora=True):
    """XLA's buffer assignment of the LoRA train step (what the plan's train terms stand for) within 20%
    of the plan (FROZEN_LAYER_STEP_BUFFERS in locojax.placement.memory was measured this way; the full
    fine-tuning step measures 0.95 of its plan at this shape)."""
    import functools

    from flax import nnx

    from locojax.model import create_model
    from locojax.spec import OptimSpec

    config = _lora_config("small") if lora else get_preset("small")
    config = config.replace(scan_layers=False)
    graphdef, params = split_params(nnx.eval_shape(lambda: create_model(config, 0)))
    optimizer = make_optimizer(OptimSpec(lr=1e-3), 10)
    state = jax.eval_shape(functools.partial(init_train_state, optimizer=optimizer, lora=lora), params)
    rows, prompt_len, new_len = 32, 64, 32
    shapes = {"tokens": ((rows, prompt_len + new_len), jnp.int32), "prompt_mask": ((rows, prompt_len), jnp.bool_),
              "completion_mask": ((rows, new_len), jnp.bool_), "old_logprobs": ((rows, new_len), jnp.float32),
              "advantages": ((rows,), jnp.float32)}
    batch = {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in shapes.items()}
    step = make_train_step(graphdef, optimizer, ALGO)
    temporaries = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    plan = plan_memory(config, rows_per_host=rows, prompt_len=prompt_len, new_len=new_len)
    assert 0.8 <= temporaries / sum(plan.train.values()) <= 1.2, (temporaries, plan.train)


@pytest.mark.slow
@pytest.mark.parametrize("early", [False, True], ids=["one-program", "early-forward"])
def test_the_compiled_plan_refuses_before_any_parameter_exists_naming_the_term(tmp_path, monkeypatch, capsys, early):
    loaded = []
    monkeypatch.setattr(common, "plans_by_compiling", lambda platform: True)
    monkeypatch.setattr(common, "load_policy", lambda spec: loaded.append(spec))
    # The tiny model, but 8,192 rows of 1,024 slots in one micro-batch: the train step's activations alone
    # are hundreds of GiB.
    spec = parse_spec({"name": "too-many-rows", "model": {"preset": "tiny"}, "task": {"name": "arith"},
                       "rollout": {"prompts_per_step": 1024, "group_size": 8, "max_prompt_tokens": 512,
                                   "max_new_tokens": 512},
                       "algo": {"micro_batch_size": 8192}, "placement": {"early_forward": early}})
    with pytest.raises(MemoryPlanError) as refused:
        common.prepare_trainer(spec, jax.devices()[:1], tmp_path, False)
    message = str(refused.value)
    # With the early forward, what the forward saves for the update (the activations) is the largest term.
    term = "train_saved_forward" if early else "train_temporaries"
    assert "compiled" in message and f"largest term is {term}" in message
    assert "model.remat: full" in message
    assert ("placement.early_forward: false" in message) == early
    assert loaded == []
    assert "memory plan per device" in capsys.readouterr().err


def test_a_program_xla_will_not_compile_for_its_size_is_a_refusal_naming_it():
    """XLA:TPU checks a program's temporaries against HBM when it compiles (Qwen3-4B LoRA at 16 rows:
    "RESOURCE_EXHAUSTED: ... HLO temporaries (16.33G) exceeds available HBM (15.75G)"), before any
    memory analysis exists: that is the plan's refusal, naming the program, XLA's figure and what would
    fit, not a crash. Other compile errors pass through. (The failing compile stands in for XLA:TPU,
    which XLA:CPU cannot be made to reproduce; the real programs compile beside it.)"""
    from locojax import compiled_plan as plan_module

    class TooLarge:  # a jitted program as _compile_all uses one: lower(*args).compile()
        def __init__(self, message):
            self.message = message

        def lower(self, *arguments):
            return self

        def compile(self):
            raise RuntimeError(self.message)

    small = jax.jit(lambda x: x * 2)
    argument = jax.ShapeDtypeStruct((4,), jnp.float32)
    hbm = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
           "(16.33G) exceeds available HBM (15.75G).\nmore detail")
    with pytest.raises(MemoryPlanError) as refused:
        plan_module._compile_all({"rollout": (small, (argument,)), "train": (TooLarge(hbm), (argument,))})
    message = str(refused.value)
    assert message.startswith("the run does not fit: XLA cannot compile the train program")
    assert "train step's temporaries" in message and "(16.33G) exceeds available HBM (15.75G)" in message
    assert "more detail" not in message and "rollout.prompts_per_step" in message
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        plan_module._compile_all({"train": (TooLarge("INVALID_ARGUMENT: bad shapes"), (argument,))})
    assert set(plan_module._compile_all({"rollout": (small, (argument,))})) == {"rollout"}


def _params(dtype="float32"):
    from locojax.model import create_model

    return split_params(create_model(get_preset("tiny").replace(param_dtype=dtype, dtype=dtype), seed=0))


def _batch(rows=8, prompt=6, new=5, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, new + 1, (rows, 1))
    return {"tokens": jnp.asarray(rng.integers(0, 380, (rows, prompt + new)), jnp.int32),
            "prompt_mask": jnp.asarray(np.arange(prompt)[None] >= rng.integers(0, 3, (rows, 1))),
            "completion_mask": jnp.asarray(np.arange(new)[None] < lengths),
            "old_logprobs": jnp.asarray(-rng.random((rows, new)), jnp.float32),
            "advantages": jnp.asarray(rng.standard_normal(rows), jnp.float32)}


@pytest.mark.slow
def test_cli_refuses_a_run_that_cannot_fit_in_one_message_exit_2(tmp_path):
    import subprocess
    import sys

    spec = tmp_path / "big.yaml"
    spec.write_text("name: big\nmodel: {preset: qwen3-32b}\nrollout: {prompts_per_step: 4, group_size: 4}\n"
                    f"output_dir: {tmp_path / 'out'}\n")
    done = subprocess.run([sys.executable, "-m", "locojax.cli", "train", str(spec), "--quiet"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "big: refused: the run does not fit" in done.stderr
    assert "memory plan per device" in done.stderr  # printed at start, then the refusal


@pytest.mark.slow
def test_chunked_completion_logprobs_equal_the_full_log_softmax_and_its_gradient():
    from locojax.model import forward, positions_from_mask

    graphdef, params = _params()
    batch = _batch()
    prompt_len = batch["prompt_mask"].shape[1]
    mask = batch["completion_mask"]

    def full(params):
        kv = jnp.concatenate([batch["prompt_mask"], mask], axis=1)
        logits, _ = forward(graphdef, params, batch["tokens"], positions_from_mask(kv), kv)
        logp = jax.nn.log_softmax(logits[:, prompt_len - 1:-1] / 0.7, axis=-1)
        token = jnp.take_along_axis(logp, batch["tokens"][:, prompt_len:, None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return jnp.where(mask, token, 0.0), jnp.where(mask, entropy, 0.0)

    def chunked(params):  # 384 columns in chunks of 100: the last chunk overlaps the third
        return completion_logprobs_and_entropy(graphdef, params, batch["tokens"], batch["prompt_mask"], mask, 0.7,
                                               vocab_chunk=100)

    (want_logp, want_entropy), (got_logp, got_entropy) = jax.jit(full)(params), jax.jit(chunked)(params)
    np.testing.assert_allclose(got_logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_entropy, want_entropy, rtol=1e-5, atol=1e-5)
    want_grad = jax.jit(jax.grad(lambda p: jnp.sum(full(p)[0])))(params)
    got_grad = jax.jit(jax.grad(lambda p: jnp.sum(chunked(p)[0])))(params)
    for want, got in zip(jax.tree.leaves(want_grad), jax.tree.leaves(got_grad)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # grads reach ~1: float32 rounding
    # One chunk (the whole vocabulary) is the same computation without the scan.
    head = jax.random.normal(jax.random.PRNGKey(1), (384, 16))
    hidden = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 16))
    targets = jnp.asarray([[0, 383, 200], [5, 6, 7]])
    one = chunked_logprobs_and_entropy(hidden, head, targets, 1.0, 4096)
    many = chunked_logprobs_and_entropy(hidden, head, targets, 1.0, 64)
    np.testing.assert_allclose(one[0], many[0], rtol=1e-6, atol=1e-6)
    # The entropy sums 384 float32 terms in chunks, in another order: 9.5e-7 apart at XLA:CPU's default
    # code generation, 3.8e-6 at the tests' LLVM level 0 (tests/conftest.py); a chunking error is ~1e-1.
    np.testing.assert_allclose(one[1], many[1], rtol=1e-5, atol=1e-5)


def _sgd(lr=0.1):
    # SGD: params_after - params_before = -lr * grad, so equal params mean equal gradients.
    return Optimizer(tx=optax.sgd(lr), lr_schedule=lambda step: jnp.float32(lr))


def _step_params(graphdef, params, batch, **kwargs):
    step = make_train_step(graphdef, _sgd(), ALGO, compiler_options=FAST_COMPILE, **kwargs)
    state, metrics = step(init_train_state(params, _sgd()), batch)
    return jax.device_get(state.params), jax.device_get(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_gives_the_same_loss_and_update(policy):
    graphdef, params = _params()
    batch = _batch()
    plain, plain_metrics = _step_params(graphdef, jax.tree.map(jnp.copy, params), batch)
    remat, remat_metrics = _step_params(graphdef, jax.tree.map(jnp.copy, params), batch, remat=policy)
    assert remat_metrics["loss/total"] == pytest.approx(float(plain_metrics["loss/total"]), rel=1e-6)
    for want, got in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_bfloat16_parameters_train():
    graphdef, params = _params("bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    optimizer = make_optimizer(parse_spec({}).optim, 10)
    step = make_train_step(graphdef, optimizer, ALGO, compiler_options=FAST_COMPILE)
    before = jax.device_get(params)
    state, metrics = step(init_train_state(params, optimizer), _batch())
    assert np.isfinite(float(metrics["loss/total"]))
    after = jax.tree.leaves(jax.device_get(state.params))
    assert {leaf.dtype for leaf in after} == {jnp.dtype(jnp.bfloat16)}
    assert any(np.any(a != b) for a, b in zip(after, jax.tree.leaves(before)))


def _trainer(tmp_path: pathlib.Path, fsdp: int, tensor: int):
    spec = parse_spec({"name": f"mesh{fsdp}{tensor}", "model": {"preset": "tiny"}, "steps": 2,
                       "rollout": {"prompts_per_step": 4, "group_size": 2, "max_prompt_tokens": 6, "max_new_tokens": 5},
                       "placement": {"devices_per_host": 4, "fsdp": fsdp, "tensor": tensor},
                       "algo": {"kl_coef": 0.0}})
    return common.prepare_trainer(spec, jax.devices()[:4], tmp_path / f"ckpt{fsdp}{tensor}", False)


@pytest.mark.slow
def test_fsdp_2_x_tensor_2_trains_like_pure_data_parallelism(tmp_path):
    """The spec's mesh reaches the trainer: params and AdamW moments sharded over fsdp and tensor, and
    one step (the spec's AdamW, and SGD for a gradient-exact comparison) gives what 4-way data
    parallelism gives."""
    batch = {k: np.asarray(v) for k, v in _batch().items()}
    data_parallel, sharded = _trainer(tmp_path, 1, 1), _trainer(tmp_path, 2, 2)
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(sharded.state.params)}
    assert any("fsdp" in str(spec) for spec in specs) and any("tensor" in str(spec) for spec in specs)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(data_parallel.state.params))
    # Every AdamW moment is laid out like its parameter (the stacked norm scales [L, D] stay replicated).
    param_specs = {}
    for leaf in jax.tree.leaves(sharded.state.params):
        param_specs.setdefault(leaf.shape, set()).add(leaf.sharding.spec)
    moments = [leaf for leaf in jax.tree.leaves(sharded.state.opt_state) if leaf.shape in param_specs]
    assert len(moments) == 2 * len(jax.tree.leaves(sharded.state.params))  # mu and nu
    assert all(leaf.sharding.spec in param_specs[leaf.shape] for leaf in moments)
    assert sum(not leaf.sharding.is_fully_replicated for leaf in moments) >= 2 * sum(
        not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(sharded.state.params)) > 0

    results = []
    for trainer in (data_parallel, sharded):
        start = jax.device_get(trainer.state.params)
        state, metrics = trainer.train_step(trainer.state, trainer.global_batch(batch))
        sgd_step = make_train_step(trainer.policy.graphdef, _sgd(), ALGO, mesh=trainer.mesh,
                                   compiler_options=FAST_COMPILE)
        placed = jax.device_put(start, jax.tree.map(lambda x: x.sharding, state.params))
        sgd_state = init_train_state(placed, _sgd())
        sgd_state, _ = sgd_step(sgd_state, trainer.global_batch(batch))
        results.append((jax.device_get(state.params), jax.device_get(metrics), jax.device_get(sgd_state.params)))
    (adam_dp, metrics_dp, sgd_dp), (adam_fs, metrics_fs, sgd_fs) = results
    for want, got in zip(jax.tree.leaves(sgd_dp), jax.tree.leaves(sgd_fs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert metrics_fs["policy/grad_norm"] == pytest.approx(float(metrics_dp["policy/grad_norm"]), rel=1e-5)
    # AdamW's first update is lr * g / (|g| + eps): gradients that are rounding noise (|g| ~ eps) can
    # move by up to lr either way, so its parameters agree to a share of lr rather than to rounding.
    lr = 3e-4 / 5  # OptimSpec's defaults: lr 3e-4 after 5 warmup steps, the first at a fifth
    for want, got in zip(jax.tree.leaves(adam_dp), jax.tree.leaves(adam_fs)):
        np.testing.assert_allclose(got, want, atol=0.5 * lr)


def test_scale_bench_sets_the_device_peak_beside_the_plan_only_where_the_runtime_reports_one(tmp_path):
    """bench/scale.py on a GPU compares the plan with the allocator's `memory/device_peak_gib`; on the
    CPU (no allocator statistics) that figure is absent and host RSS stays the comparison."""
    import json
    import types

    from bench import scale

    def metrics(peaks):
        rows = [{"step": s, "host": "all", "time/step": 1.0, "time/rollout": 0.4, "time/train": 0.5,
                 "throughput/rollout_tokens_per_s": 10.0, **({"memory/device_peak_gib": p} if p else {})}
                for s, p in enumerate(peaks)]
        path = tmp_path / f"metrics-{len(peaks)}-{peaks[0]}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    on_gpu = scale.step_figures(metrics([6.0, 7.5, 7.0]), steps=3)
    on_cpu = scale.step_figures(metrics([None, None, None]), steps=3)
    assert on_gpu["peak_device_gib"] == 7.5 and on_cpu["peak_device_gib"] is None

    args = types.SimpleNamespace(prompts=4, group=4, prompt_tokens=96, new_tokens=32, dtype="float32",
                                 remat="full", micro_batch_size=None, platform="gpu", seed=0,
                                 model_preset="qwen3-0.6b", load_note="")
    limits = {"decode_vs_roofline": 0.5, "matmul_peak_gflop_s": 1000.0, "params": 1000,
              "config": {"vocab_size": 10, "d_model": 4, "n_layers": 1, "n_heads": 1, "head_dim": 4}}

    def rounds(figures):
        return [{**figures, "peak_rss_gib": 3.0, "planned_gib": 10.0, "plan_line": "memory plan per device"}]

    gpu = scale.summarise(args, limits, rounds(on_gpu), None, (0.0, 0.0, 0.0), 1.0)
    assert gpu["peak_device_vs_plan"] == pytest.approx(0.75) and gpu["platform"] == "gpu"
    cpu = scale.summarise(args, limits, rounds(on_cpu), None, (0.0, 0.0, 0.0), 1.0)
    assert cpu["peak_device_gib"] is None and cpu["peak_device_vs_plan"] is None
    assert cpu["peak_rss_vs_plan"] == pytest.approx(0.3)


def test_scale_bench_decode_rows_option_names_itself_on_bad_input():
    """--decode-rows (the limits phase's decode at fewer rows) takes comma-separated counts >= 1; anything
    else is refused by argparse with the option's name, before the bench builds or loads a model."""
    import argparse

    from bench import scale

    assert scale._row_counts("1, 4,8") == (1, 4, 8) and scale._row_counts("") == ()
    for bad in ("4,x", "0,4"):
        with pytest.raises(argparse.ArgumentTypeError, match="--decode-rows"):
            scale._row_counts(bad)


def test_on_a_tpu_a_programs_temporaries_are_its_peak_beyond_its_arguments():
    """XLA:TPU's runtime reserves for a program its heap peak beyond the arguments, not the temporary
    allocation XLA reports (Qwen3-0.6B bf16, 128 rows, measured on a v5e: train reserved 4.40 GiB,
    peak - arguments 4.08, temp_size 7.15); the plan takes that figure there, and temp_size elsewhere
    (XLA:CPU reports no meaningful peak)."""
    from types import SimpleNamespace

    from locojax import compiled_plan as plan_module

    gib = 2**30
    # The v5e's train step at that shape: the donated state in and out, a 1 KiB batch.
    train = SimpleNamespace(temp_size_in_bytes=7.15 * gib, peak_memory_in_bytes=7.41 * gib,
                            argument_size_in_bytes=3.33 * gib + 1024, output_size_in_bytes=3.33 * gib,
                            alias_size_in_bytes=3.33 * gib)
    on_tpu = plan_module._transient(train, 3.33 * gib, "tpu")
    assert on_tpu["temporaries"] == pytest.approx(4.08 * gib) and on_tpu["inputs"] == pytest.approx(1024)
    assert on_tpu["outputs"] == 0
    on_cpu = plan_module._transient(train, 3.33 * gib, "cpu")
    assert on_cpu == {**on_tpu, "temporaries": 7.15 * gib}
    # Outputs that overwrite no argument are their own term, not counted again among the temporaries.
    rollout = SimpleNamespace(temp_size_in_bytes=1.17 * gib, peak_memory_in_bytes=3.38 * gib,
                              argument_size_in_bytes=2.22 * gib, output_size_in_bytes=0.01 * gib,
                              alias_size_in_bytes=0)
    terms = plan_module._transient(rollout, 2.22 * gib, "tpu")
    assert terms["outputs"] == pytest.approx(0.01 * gib)
    assert terms["temporaries"] + terms["outputs"] == pytest.approx(1.16 * gib)
