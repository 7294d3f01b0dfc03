"""Orbax checkpoints of the whole TrainState: bit-exact restore, keep-K, async save vs donation, warm start."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from locojax.checkpoint import Checkpointer, load_params
from locojax.spec import OptimSpec
from locojax.train import TrainState, init_train_state, make_optimizer
from tests.locojax.test_train import fresh_params

OPTIMIZER = make_optimizer(OptimSpec(lr=1e-3), total_steps=10)


def state_at(step: int, seed: int = 0) -> TrainState:
    """A TrainState whose every leaf (params, Adam moments and count, step, key) holds distinct values,
    built with numpy so no XLA op compiles."""
    rng = np.random.default_rng(seed)
    state = init_train_state(fresh_params(), OPTIMIZER, seed=seed)

    def perturb(x):
        x = np.asarray(x)
        noise = rng.integers(1, 100, x.shape) if x.dtype.kind in "iu" else rng.normal(size=x.shape)
        return jax.device_put((x + noise).astype(x.dtype))

    return state.replace(params=jax.tree.map(perturb, state.params), opt_state=jax.tree.map(perturb, state.opt_state),
                         step=jax.device_put(np.int32(step)), rng=perturb(state.rng))


def host_copy(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def assert_identical(restored, expected_host):
    assert jax.tree.structure(restored) == jax.tree.structure(expected_host)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected_host), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)


def test_save_restore_is_bit_identical_even_when_the_state_is_donated_after_save(tmp_path):
    state = state_at(4)
    expected = host_copy(state)
    with Checkpointer(tmp_path, every=2, keep=3) as ckpt:
        assert ckpt.save(state, {"run_name": "demo", "data_position": {"epoch": 0, "index": 96}})
        # The next train step donates the state while the save may still be writing.
        bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
        bumped = bump(state)
        assert state.params["embed"][...].is_deleted()
        bumped = bump(bumped)

    with Checkpointer(tmp_path, every=2, keep=3) as fresh:  # as a restarted process would
        restored, extra = fresh.restore_latest(state_at(0, seed=1))
    assert_identical(restored, expected)
    assert extra == {"run_name": "demo", "data_position": {"epoch": 0, "index": 96}, "step": 4}


def test_saves_every_n_steps_and_keeps_the_newest_k(tmp_path):
    with Checkpointer(tmp_path, every=2, keep=2) as ckpt:
        saved = {step: ckpt.save(state_at(step, seed=step)) for step in range(1, 7)}
        assert saved == {1: False, 2: True, 3: False, 4: True, 5: False, 6: True}
        assert ckpt.save(state_at(7, seed=7), force=True)  # e.g. the last step of a run
        assert not ckpt.save(state_at(7, seed=7), force=True)  # a step is saved once
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
        restored, extra = ckpt.restore(state_at(0), step=6)
    assert_identical(restored, host_copy(state_at(6, seed=6)))
    assert extra == {"step": 6}


def test_restore_latest_on_an_empty_directory_is_none_and_every_zero_never_saves(tmp_path):
    with Checkpointer(tmp_path, every=0, keep=1) as ckpt:
        assert ckpt.restore_latest(state_at(0)) is None
        assert not ckpt.save(state_at(5))
        with pytest.raises(FileNotFoundError):
            ckpt.restore(state_at(0))
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)


@pytest.mark.usefixtures("four_cpu_devices")
def test_restore_uses_the_template_sharding_and_load_params_warm_starts(tmp_path):
    state = state_at(3)
    expected = host_copy(state)
    with Checkpointer(tmp_path, every=1, keep=1) as ckpt:
        ckpt.save(state)
        mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
        template = jax.device_put(state_at(0), NamedSharding(mesh, PartitionSpec()))
        restored, _ = ckpt.restore_latest(template)
    assert_identical(restored, expected)
    assert all(leaf.sharding == NamedSharding(mesh, PartitionSpec()) for leaf in jax.tree.leaves(restored))

    params = load_params(tmp_path, fresh_params())  # e.g. GRPO starting from an SFT run
    assert_identical(params, expected.params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_export_writes_every_tensor_row_major_and_reloads_exactly(tmp_path, dtype):
    """The file holds each tensor's values in row-major order, whatever layout the device hands back.

    On a TPU `np.asarray` of a (384, 64) float32 device array returned a column-major view, and an
    exporter that wrote the raw memory of such a view saved the transpose's bytes (reloaded.flat[1] was
    original[1, 0]). Runs in bench/tpu.sh's test stage; needs no torch."""
    from flax import nnx
    from safetensors.numpy import load_file

    from locojax.model import create_model, get_preset
    from locojax.model.hf import _tensor_map, _variable_at, load_hf_checkpoint, save_hf_checkpoint

    # Untied, so the (384, 64) embedding and head are both written; every shape of the model is covered.
    config = get_preset("tiny").replace(tie_embeddings=False, param_dtype=dtype, dtype=dtype)
    model = create_model(config, seed=3)
    save_hf_checkpoint(model, tmp_path)
    written = load_file(str(tmp_path / "model.safetensors"))
    _, state = nnx.split(model)
    for hf_name, path, layer, _, to_hf in _tensor_map(config):
        value = np.asarray(jax.device_get(_variable_at(state, path)[...]))
        original = to_hf(value if layer is None else value[layer])  # a stacked layer parameter's row
        assert written[hf_name].shape == original.shape, hf_name
        assert np.array_equal(written[hf_name], original), f"{hf_name} was written in another element order"
    reloaded = load_hf_checkpoint(tmp_path, dtype=dtype)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reloaded)), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
