"""Qwen3-architecture policy model: config and presets, the NNX decoder, sharding, HF checkpoints."""

from locojax.model.config import PRESETS, ModelConfig, get_preset, param_count
from locojax.model.transformer import (
    Cache,
    Transformer,
    create_model,
    forward,
    init_cache,
    positions_from_mask,
)

__all__ = [
    "PRESETS", "ModelConfig", "get_preset", "param_count", "Cache", "Transformer", "create_model",
    "forward", "init_cache", "positions_from_mask",
]
