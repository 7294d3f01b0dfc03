"""What a Hugging Face `config.json` says, read without JAX: the control plane prices a run that starts
from a checkpoint (its dimensions, not its spec's preset name) and `locojax.model.hf` loads it."""

from __future__ import annotations

from typing import Any

from locojax.model.config import ModelConfig

_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers 5 nests it under rope_parameters; older configs keep it at the top level.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise CheckpointError(f"config.json: rope_type {rope_type!r} is not supported (only default RoPE)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def config_from_hf(hf: dict[str, Any], name: str = "hf", dtype: str = "float32") -> ModelConfig:
    """ModelConfig from a parsed HF `config.json`."""
    arch = None
    for candidate in hf.get("architectures") or []:
        arch = arch or _ARCHITECTURES.get(candidate)
    arch = arch or _MODEL_TYPES.get(hf.get("model_type", ""))
    if arch is None:
        raise CheckpointError(
            f"config.json: unknown architecture {hf.get('architectures') or hf.get('model_type')!r}; "
            f"supported: {', '.join(_ARCHITECTURES)}"
        )
    try:
        heads = int(hf["num_attention_heads"])
        return ModelConfig(
            name=name,
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            d_model=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            d_ff=int(hf["intermediate_size"]),
            rope_theta=_rope_theta(hf),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            max_seq_len=int(hf.get("max_position_embeddings", 4096)),
            param_dtype=dtype,
            dtype=dtype,
        )
    except KeyError as exc:
        raise CheckpointError(f"config.json: missing field {exc.args[0]!r}") from None
