"""The policy a run starts from, at engine level (placement's probe and evaluation load it too, and
neither may depend on the modes): its config, graph, params and tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from locojax.model import LoRAConfig, ModelConfig, create_model, get_preset
from locojax.placement.memory import spec_lora_config
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


def lora_config(spec: RunSpec) -> LoRAConfig | None:
    """The spec's model.lora as the model's config (None: every weight is trained)."""
    return spec_lora_config(spec)


def _policy_config(spec: RunSpec) -> ModelConfig:
    """The config `load_policy` builds, read without building the model (a HF directory's config.json)."""
    return _base_config(spec).replace(lora=lora_config(spec))


def _base_config(spec: RunSpec) -> ModelConfig:
    if not spec.model.checkpoint:
        return get_preset(spec.model.preset).replace(param_dtype=spec.model.dtype, dtype=spec.model.dtype,
                                                      scan_layers=spec.model.scan_layers)
    import json

    from locojax.model.hf import config_from_hf

    path = Path(spec.model.checkpoint)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.checkpoint: {path} holds no config.json (expected a HF directory, "
                                "e.g. <output_dir>/model of a finished SFT run)")
    return config_from_hf(json.loads((path / "config.json").read_text(encoding="utf-8")), name=path.name,
                          dtype=spec.model.dtype).replace(scan_layers=spec.model.scan_layers)


def abstract_policy(spec: RunSpec) -> Policy:
    """`load_policy`'s result as shapes only (params are ShapeDtypeStructs; nothing is allocated or read
    but the config), with the same config and graph, for compiling the run's programs ahead of time."""
    from locojax.model import Transformer

    config = _policy_config(spec)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=spec.seed)))
    graphdef, params = split_params(model)
    return Policy(config, graphdef, params, load_tokenizer(spec.model.tokenizer))


def load_policy(spec: RunSpec, mesh: Mesh | None = None) -> Policy:
    """The starting policy: a preset initialised from the run's seed, or a local HF checkpoint
    directory (e.g. `<output_dir>/model` of an SFT run). Every host builds bit-identical params.
    With model.lora the model carries adapters: fresh ones (B = 0: the base model's outputs), or those
    of the saved adapter `model.lora.init_from`. `mesh`: a preset's fresh weights are drawn where
    `shard_state` would place them on it (`create_model`), which saves compiling the placement."""
    tokenizer = load_tokenizer(spec.model.tokenizer)
    if spec.model.checkpoint:
        from locojax.model.hf import load_hf_checkpoint

        path = Path(spec.model.checkpoint)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.checkpoint: {path} holds no config.json (expected a HF directory, "
                                    "e.g. <output_dir>/model of a finished SFT run)")
        model = load_hf_checkpoint(path, dtype=spec.model.dtype, scan_layers=spec.model.scan_layers)
        if spec.model.lora is not None:
            from locojax.model.hf import with_adapters

            model = with_adapters(model, lora_config(spec), spec.seed)
    else:
        model = create_model(_policy_config(spec), seed=spec.seed, mesh=mesh)
    if spec.model.lora is not None and spec.model.lora.init_from:
        from locojax.model.hf import load_peft_adapter

        model = load_peft_adapter(spec.model.lora.init_from, model)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"model.tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                         f"{model.config.vocab_size}")
    graphdef, params = split_params(model)
    return Policy(model.config, graphdef, params, tokenizer)


def sampling_config(spec: RunSpec, tokenizer: Tokenizer) -> SamplingConfig:
    return SamplingConfig.from_spec(spec.rollout, tokenizer)


def to_local(params: nnx.State, sharding: NamedSharding) -> nnx.State:
    """A host-local replicated copy of params, placed on this host's rollout mesh, device to device: no
    cross-host traffic and no copy through host memory. Params are replicated across hosts (sharded
    over fsdp/tensor within a host at most), so every host holds them whole.

    Params already placed so (one device, or replicated over the same devices) come back as they are,
    not copied: a copy cost the host ~1 ms a step on a TPU (an array object per leaf, twice) while the
    device waited for the rollout's dispatch. They are the same buffers: the train step that donates
    them must come after every program that reads them is dispatched (the runtime then orders the
    donation after those reads), and no caller may keep them past it."""
    if already_local(params, sharding):
        return params
    return jax.device_put(jax.tree.map(host_copy, params), sharding)


def already_local(params: nnx.State, sharding: NamedSharding) -> bool:
    """Whether `to_local(params, sharding)` is `params` itself: every leaf (arrays, or abstract
    `ShapeDtypeStruct`s with their shardings, as the compiled plan lowers the run's programs with) is
    already placed as `sharding` places it."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and all(getattr(x, "sharding", None) is not None
                                and x.sharding.is_equivalent_to(sharding, len(x.shape)) for x in leaves)


def host_copy(x: jax.Array):
    """This host's whole copy of `x` (replicated across hosts, maybe sharded over its own devices), as
    an array on this host's devices; nothing is copied to host memory unless `x` is split across hosts.
      * replicated: one device's copy;
      * only this process's devices (one process): `x` itself;
      * sharded over this host's devices only (FSDP/tensor > 1 on a multi-process run): the same shards,
        viewed as an array over this process's part of the mesh.
    """
    if x.is_fully_replicated:
        return x.addressable_data(0)
    if x.is_fully_addressable:
        return x
    local = _host_local_view(x)
    if local is not None:
        return local
    # Split across processes: this host's shards do not hold the whole array, which would need a
    # cross-host gather (no mode's layout shards params over hosts). The host-memory assembly below
    # is correct only when the local shards still cover every index; anything else is refused.
    whole = np.empty(x.shape, x.dtype)
    covered = np.zeros(x.shape, bool)
    for shard in x.addressable_shards:
        whole[shard.index] = np.asarray(shard.data)
        covered[shard.index] = True
    if not covered.all():
        raise ValueError(f"an array of shape {x.shape} is split across processes ({x.sharding}); a host-local "
                         "copy of it needs a cross-host gather")
    return whole


def _host_local_view(x: jax.Array) -> jax.Array | None:
    """`x`'s shards on this process as one fully addressable array, when every mesh axis `x` is split
    over lies within this process (so its local shards hold the whole array); else None."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    try:
        local = mesh.local_mesh  # this process's devices, as a sub-block of the mesh
    except ValueError:  # they are not a contiguous sub-block
        return None
    split_over = {axis for part in sharding.spec if part is not None
                  for axis in ((part,) if isinstance(part, str) else part)}
    if any(local.shape[axis] != mesh.shape[axis] for axis in split_over):
        return None  # some split crosses processes
    local = Mesh(local.devices, mesh.axis_names, axis_types=mesh.axis_types)
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(local, sharding.spec), [shard.data for shard in x.addressable_shards])
