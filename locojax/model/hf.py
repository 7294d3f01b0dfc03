"""Hugging Face checkpoints: load a local Qwen3 / Llama directory into the NNX model, and export back.

A directory holds `config.json` and either `model.safetensors` or a sharded
`model.safetensors.index.json`. Linear weights are [out, in] on both sides (ours split the heads'
axis into (heads, head_dim)), so loading and export only reshape — the round trip is exact. Each
per-layer tensor `model.layers.{i}.*` is row i of our stacked layer parameter (`layers` axis first).
Nothing is downloaded: paths are local.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from locojax.model.config import LORA_MODULES, LoRAConfig, ModelConfig, ScanLayers
from locojax.model.hf_config import CheckpointError, config_from_hf  # noqa: F401  (the names this module's users import)
from locojax.model.transformer import Transformer


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    architecture = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[config.arch]
    return {
        "architectures": [architecture],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.d_ff,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_seq_len,
        "attention_bias": False,
        "torch_dtype": config.param_dtype,
    }


# One row per tensor: (HF name, path in our state, layer, HF array -> ours, ours -> HF array). `layer`:
# the tensor's index on the leading axis of a stacked decoder parameter (None for the others).
Mapping = tuple[str, tuple[str, ...], int | None, Callable[[np.ndarray], np.ndarray],
                Callable[[np.ndarray], np.ndarray]]


def _tensor_map(c: ModelConfig) -> list[Mapping]:
    ident = (lambda a: a, lambda a: a)  # linear weights are [out, in] on both sides

    def heads_in(n):  # HF [n*Dh, D] <-> ours [n, Dh, D]
        return (lambda a: a.reshape(n, c.head_dim, c.d_model), lambda a: a.reshape(n * c.head_dim, c.d_model))

    heads_out = (  # HF [D, H*Dh] <-> ours [D, H, Dh]
        lambda a: a.reshape(c.d_model, c.n_heads, c.head_dim),
        lambda a: a.reshape(c.d_model, c.n_heads * c.head_dim),
    )
    rows: list[Mapping] = [("model.embed_tokens.weight", ("embed",), None, *ident),
                           ("model.norm.weight", ("final_norm", "weight"), None, *ident)]
    if not c.tie_embeddings:
        rows.append(("lm_head.weight", ("lm_head",), None, *ident))
    for i in range(c.n_layers):
        hf = f"model.layers.{i}"
        rows += [
            (f"{hf}.input_layernorm.weight", ("layers", "input_norm", "weight"), i, *ident),
            (f"{hf}.post_attention_layernorm.weight", ("layers", "post_attention_norm", "weight"), i, *ident),
            (f"{hf}.self_attn.q_proj.weight", ("layers", "attention", "q_proj"), i, *heads_in(c.n_heads)),
            (f"{hf}.self_attn.k_proj.weight", ("layers", "attention", "k_proj"), i, *heads_in(c.n_kv_heads)),
            (f"{hf}.self_attn.v_proj.weight", ("layers", "attention", "v_proj"), i, *heads_in(c.n_kv_heads)),
            (f"{hf}.self_attn.o_proj.weight", ("layers", "attention", "o_proj"), i, *heads_out),
            (f"{hf}.mlp.gate_proj.weight", ("layers", "mlp", "gate_proj"), i, *ident),
            (f"{hf}.mlp.up_proj.weight", ("layers", "mlp", "up_proj"), i, *ident),
            (f"{hf}.mlp.down_proj.weight", ("layers", "mlp", "down_proj"), i, *ident),
        ]
        if c.qk_norm:
            rows += [
                (f"{hf}.self_attn.q_norm.weight", ("layers", "attention", "q_norm", "weight"), i, *ident),
                (f"{hf}.self_attn.k_norm.weight", ("layers", "attention", "k_norm", "weight"), i, *ident),
            ]
    return rows


def _variable_at(state: nnx.State, path: tuple[Any, ...]) -> nnx.Variable:
    node = state
    for key in path:
        node = node[key]
    return node


def _safetensors_files(directory: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: directory / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise CheckpointError(f"{index} names a missing shard: {file}")
        return files
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="numpy") as handle:
            return {name: single for name in handle.keys()}
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def _read_tensors(files: dict[str, Path], names: list[str]) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in names:
        if name not in files:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, np.ndarray] = {}
    for file, file_names in by_file.items():
        # framework="flax" reads bfloat16 too (numpy has no bfloat16 of its own).
        with safe_open(str(file), framework="flax") as handle:
            for name in file_names:
                tensors[name] = np.asarray(handle.get_tensor(name))
    return tensors


def load_hf_checkpoint(directory: str | Path, dtype: str = "float32", scan_layers: ScanLayers = "auto") -> Transformer:
    """Build a Transformer from a local HF directory. Errors name the missing file or mismatched tensor.
    `scan_layers`: the config's (how the forward iterates the layers; the parameters are the same)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: config.json not found")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None
    config = config_from_hf(hf_config, name=directory.name, dtype=dtype).replace(scan_layers=scan_layers)
    # Tied configs may still ship an lm_head copy; ignore it then.
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    rows = _tensor_map(config)
    tensors = _read_tensors(_safetensors_files(directory), [row[0] for row in rows])
    values: dict[tuple[str, ...], np.ndarray] = {}  # path -> our value, stacked layers filled in one by one
    for hf_name, path, layer, to_ours, _ in rows:
        shape = tuple(_variable_at(state, path).get_value().shape)
        expected = shape if layer is None else shape[1:]
        tensor = tensors.pop(hf_name)  # dropped once copied: loading holds about one extra model copy
        try:
            value = to_ours(tensor)
        except ValueError:  # a reshape that cannot fit: the same mismatch, reported below
            value = tensor
        if value.shape != expected:
            raise CheckpointError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}; the config expects a tensor "
                f"that maps to {expected}"
            )
        if layer is None:
            values[path] = value
        else:
            values.setdefault(path, np.empty(shape, value.dtype))[layer] = value
    for path in list(values):
        # A copy JAX owns: now that loading only reshapes, asarray would alias the reader's buffers on CPU,
        # which the train step cannot donate (the 0.6B run's peak RSS rose 1.5 GiB).
        value = values.pop(path)
        _variable_at(state, path).set_value(jnp.array(value, dtype=jnp.dtype(config.param_dtype), copy=True))
    return nnx.merge(graphdef, state)


def row_major(x) -> np.ndarray:
    """A host copy of `x` whose memory is in row-major (C) order.

    On a TPU, `np.asarray` of a device array may return a column-major view (a (384, 64) float32 matrix
    came back with strides (4, 1536)); a writer that takes the raw bytes of such a view (safetensors does)
    stores the transpose's bytes under the original shape, and the model loads garbled."""
    return np.ascontiguousarray(np.asarray(x))


def _adapter_path(target: str, which: str) -> tuple[str, ...]:
    """Where target's LoRA matrix `which` ("a" or "b") lives in our (stacked) state."""
    module = "attention" if LORA_MODULES[target].startswith("self_attn") else "mlp"
    return ("layers", module, f"{target}_lora_{which}")


def _adapter_deltas(model: Transformer) -> dict[str, np.ndarray]:
    """HF weight name -> scale * B @ A ([out, in], float32): what merging the adapters adds to it."""
    lora = model.config.lora
    if lora is None:
        return {}
    state = nnx.state(model)
    deltas = {}
    for target in lora.targets:
        a = np.asarray(_variable_at(state, _adapter_path(target, "a"))[...], np.float32)  # [L, r, in]
        b = np.asarray(_variable_at(state, _adapter_path(target, "b"))[...], np.float32)  # [L, out, r]
        for i in range(model.config.n_layers):
            deltas[f"model.layers.{i}.{LORA_MODULES[target]}.weight"] = lora.scale * (b[i] @ a[i])
    return deltas


def save_hf_checkpoint(model: Transformer, directory: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` that `transformers` (and `load_hf_checkpoint`) can read.
    A model with LoRA adapters is written merged: each adapted weight becomes W + (alpha/r) B A, so the
    directory is a plain model of the same outputs (`save_peft_adapter` writes the adapters alone)."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    _, state = nnx.split(model)
    deltas = _adapter_deltas(model)
    host: dict[tuple[str, ...], np.ndarray] = {}  # path -> one host copy of our value
    tensors = {}
    for hf_name, path, layer, _, to_hf in _tensor_map(config):
        # Host arrays, row-major after the reshape: handing device arrays to safetensors.flax would let it
        # take the raw memory of whatever layout np.asarray returns (see `row_major`).
        if path not in host:
            host[path] = row_major(_variable_at(state, path)[...])
        tensor = row_major(to_hf(host[path] if layer is None else host[path][layer]))
        if hf_name in deltas:
            tensor = (tensor.astype(np.float32) + deltas.pop(hf_name)).astype(tensor.dtype)
        tensors[hf_name] = tensor
    (directory / "config.json").write_text(json.dumps(config_to_hf(config), indent=2), encoding="utf-8")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


# PEFT's names for the adapters of a causal LM (`PeftModelForCausalLM` wraps the model as base_model.model).
PEFT_PREFIX = "base_model.model."
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def _peft_name(layer: int, target: str, which: str) -> str:
    return f"{PEFT_PREFIX}model.layers.{layer}.{LORA_MODULES[target]}.lora_{which.upper()}.weight"


def save_peft_adapter(model: Transformer, directory: str | Path, base_model: str | None = None) -> Path:
    """Write the model's adapters as a PEFT LoRA adapter: `adapter_config.json` + `adapter_model.safetensors`
    (lora_A.weight [r, in], lora_B.weight [out, r] per layer and target, float32), which
    `peft.PeftModel.from_pretrained` loads onto the `transformers` base model."""
    from safetensors.numpy import save_file

    lora = model.config.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapters to save (ModelConfig.lora is None)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model)
    tensors = {}
    for target in lora.targets:
        for which in ("a", "b"):
            stacked = row_major(np.asarray(_variable_at(state, _adapter_path(target, which))[...], np.float32))
            for i in range(model.config.n_layers):
                tensors[_peft_name(i, target, which)] = np.ascontiguousarray(stacked[i])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
        "target_modules": sorted(LORA_MODULES[t].split(".")[-1] for t in lora.targets),
    }
    (directory / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(directory / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def load_peft_adapter(directory: str | Path, model: Transformer) -> Transformer:
    """`model` with its adapters replaced by a saved PEFT adapter's (e.g. one `save_peft_adapter` wrote).
    The adapter's rank, alpha and target modules must be the model's; errors name what differs."""
    from safetensors import safe_open

    lora = model.config.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapters to load into (ModelConfig.lora is None)")
    directory = Path(directory)
    config_path, weights_path = directory / PEFT_CONFIG_FILE, directory / PEFT_WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(f"{directory}: {path.name} not found (expected a PEFT LoRA adapter directory)")
    saved = json.loads(config_path.read_text(encoding="utf-8"))
    targets = sorted(LORA_MODULES[t].split(".")[-1] for t in lora.targets)
    found = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha"),
             "target_modules": sorted(saved.get("target_modules") or [])}
    expected = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": targets}
    for key, value in expected.items():
        if found[key] != value:
            raise CheckpointError(f"{config_path}: {key} is {found[key]!r}, the spec's model.lora gives {value!r}")
    state = nnx.state(model)
    with safe_open(str(weights_path), framework="numpy") as handle:
        names = set(handle.keys())
        for target in lora.targets:
            for which in ("a", "b"):
                variable = _variable_at(state, _adapter_path(target, which))
                shape = tuple(variable.get_value().shape)
                layers = []
                for i in range(model.config.n_layers):
                    name = _peft_name(i, target, which)
                    if name not in names:
                        raise CheckpointError(f"{weights_path}: missing tensor {name!r}")
                    tensor = handle.get_tensor(name)
                    if tuple(tensor.shape) != shape[1:]:
                        raise CheckpointError(f"{weights_path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                              f"expected {shape[1:]}")
                    layers.append(tensor)
                variable.set_value(jnp.asarray(np.stack(layers), variable.get_value().dtype))
    nnx.update(model, state)
    return model


def with_adapters(model: Transformer, lora: LoRAConfig, seed: int) -> Transformer:
    """`model`'s weights with fresh LoRA adapters (as `Transformer` draws them for `seed`) beside them."""
    from locojax.model.transformer import create_model

    adapted = create_model(model.config.replace(lora=lora), seed=seed)
    nnx.update(adapted, nnx.state(model, nnx.Param))
    return adapted
