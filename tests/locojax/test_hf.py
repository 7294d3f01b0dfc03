"""Parity with `transformers` (a reference nobody here wrote) and the HF checkpoint round trip."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from locojax.model import create_model, get_preset  # noqa: E402
from locojax.model.hf import CheckpointError, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

TINY_DIMS = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _reference_model(kind: str, tie: bool, directory):
    torch.manual_seed(0)
    if kind == "qwen3":
        config = transformers.Qwen3Config(tie_word_embeddings=tie, rope_theta=1_000_000.0, **TINY_DIMS)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(tie_word_embeddings=tie, rms_norm_eps=1e-5, **TINY_DIMS)
        model = transformers.LlamaForCausalLM(config)
    # Random norms too, so a swapped or skipped norm weight cannot hide behind all-ones.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(directory)
    return model


def _left_padded_inputs(batch=3, length=12):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY_DIMS["vocab_size"], (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@pytest.mark.parametrize("kind,tie", [("qwen3", True), ("qwen3", False), ("llama", False)])
def test_logits_match_transformers_on_left_padded_batch(tmp_path, kind, tie):
    reference = _reference_model(kind, tie, tmp_path)
    ids, mask, positions = _left_padded_inputs()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits.numpy()

    ours = load_hf_checkpoint(tmp_path)
    assert ours.config.arch == kind and ours.config.qk_norm == (kind == "qwen3")
    logits, _ = ours(jnp.asarray(ids.numpy()), jnp.asarray(positions.numpy()), jnp.asarray(mask.numpy() > 0))
    real = mask.numpy() > 0
    assert np.abs(np.asarray(logits) - expected)[real].max() <= 1e-4


def test_export_then_load_is_exact_and_transformers_reads_it(tmp_path):
    model = create_model(get_preset("tiny").replace(tie_embeddings=False), seed=7)
    save_hf_checkpoint(model, tmp_path)
    again = load_hf_checkpoint(tmp_path)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again)), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    reference = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask, positions = _left_padded_inputs()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits.numpy()
    logits, _ = model(jnp.asarray(ids.numpy()), jnp.asarray(positions.numpy()), jnp.asarray(mask.numpy() > 0))
    assert np.abs(np.asarray(logits) - expected)[mask.numpy() > 0].max() <= 1e-4


def test_sharded_index_checkpoint_loads(tmp_path):
    reference = _reference_model("qwen3", True, tmp_path / "single")
    (tmp_path / "sharded").mkdir()
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = load_hf_checkpoint(tmp_path / "single")
    b = load_hf_checkpoint(tmp_path / "sharded")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_missing_files_and_bad_tensors_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_hf_checkpoint(tmp_path)

    save_hf_checkpoint(create_model(get_preset("tiny")), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"],
                                                      "model_type": "mamba"}))
    with pytest.raises(CheckpointError, match="unknown architecture"):
        load_hf_checkpoint(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight"):
        load_hf_checkpoint(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\."):
        load_hf_checkpoint(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_checkpoint(tmp_path)
