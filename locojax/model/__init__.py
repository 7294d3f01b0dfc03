"""Qwen3-architecture policy model: config and presets, the NNX decoder, sharding, HF checkpoints.

The config and presets import no JAX, so the control plane (spec validation, the catalog) can use
them without loading JAX; the decoder's names are imported on first use.
"""

from __future__ import annotations

import importlib

from locojax.model.config import PRESETS, LoRAConfig, ModelConfig, get_preset, lora_param_count, param_count

_DECODER_NAMES = ("Cache", "LoRAParam", "Transformer", "adapters_off", "create_model", "fold_adapters_for_rollout",
                  "forward", "init_cache", "layer_params", "positions_from_mask", "split_adapters")


def __getattr__(name: str):
    if name in _DECODER_NAMES:
        return getattr(importlib.import_module("locojax.model.transformer"), name)
    raise AttributeError(f"module 'locojax.model' has no attribute {name!r}")


__all__ = ["PRESETS", "LoRAConfig", "ModelConfig", "get_preset", "lora_param_count", "param_count", *_DECODER_NAMES]
