"""The policy a run starts from, at engine level (placement's probe and evaluation load it too, and
neither may depend on the modes): its config, graph, params and tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from locojax.model import ModelConfig, create_model, get_preset
from locojax.rollout import SamplingConfig
from locojax.spec import RunSpec
from locojax.tokenizer import Tokenizer, load_tokenizer
from locojax.train import split_params


@dataclasses.dataclass
class Policy:
    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Tokenizer


def load_policy(spec: RunSpec) -> Policy:
    """The starting policy: a preset initialised from the run's seed, or a local HF checkpoint
    directory (e.g. `<output_dir>/model` of an SFT run). Every host builds bit-identical params."""
    tokenizer = load_tokenizer(spec.model.tokenizer)
    if spec.model.checkpoint:
        from locojax.model.hf import load_hf_checkpoint

        path = Path(spec.model.checkpoint)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.checkpoint: {path} holds no config.json (expected a HF directory, "
                                    "e.g. <output_dir>/model of a finished SFT run)")
        model = load_hf_checkpoint(path, dtype=spec.model.dtype)
    else:
        config = get_preset(spec.model.preset).replace(param_dtype=spec.model.dtype, dtype=spec.model.dtype)
        model = create_model(config, seed=spec.seed)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"model.tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                         f"{model.config.vocab_size}")
    graphdef, params = split_params(model)
    return Policy(model.config, graphdef, params, tokenizer)


def sampling_config(spec: RunSpec, tokenizer: Tokenizer) -> SamplingConfig:
    return SamplingConfig.from_spec(spec.rollout, tokenizer)


def to_local(params: nnx.State, sharding: NamedSharding) -> nnx.State:
    """A host-local replicated copy of params, placed on this host's rollout mesh. No cross-host
    traffic: params are replicated across hosts (sharded over fsdp/tensor within a host at most), so
    every host holds them whole."""
    return jax.device_put(jax.tree.map(host_copy, params), sharding)


def host_copy(x: jax.Array):
    """This host's whole copy of `x` (replicated across hosts, maybe sharded over its own devices)."""
    if x.is_fully_replicated:
        return x.addressable_data(0)
    if x.is_fully_addressable:
        return x
    # Sharded over this host's devices only: its own shards hold the whole array.
    whole = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        whole[shard.index] = np.asarray(shard.data)
    return whole
