"""The memory plan: bytes per device of one GRPO run, term by term, before anything is allocated.

One estimate serves the engine (printed at start; a run that cannot fit is refused before its
parameters exist) and the placement recommender (it never recommends a placement whose plan does not
fit HBM). Pure arithmetic over `ModelConfig` and the run's shapes; no JAX at import time, so the
control plane can call it. The device capacity of the local machine (`device_capacity`) is the only
function here that asks JAX.

Per device, with P parameters on a per-host mesh data x fsdp x tensor (the parameters sharded over
fsdp x tensor, `locojax.model.sharding.LOGICAL_RULES`). With LoRA (`ModelConfig.lora`) the weights are
frozen and counted once; gradients, AdamW's moments and the KL reference (the base with the adapters
zeroed) are adapter-sized, and the adapters (float32, replicated) are a term of their own:
  * persistent: params, AdamW's two moments (the params' dtype), the frozen reference (kl_coef > 0;
    kept replicated, as rollout reads it host-locally), and the replicated copy rollout decodes from
    when training shards the params (fsdp x tensor > 1);
  * the train step's transients: gradients, the optimizer's update and the backward's buffers
    (float32 accumulators when micro-batched; factors measured from XLA's buffer assignment), the activations autodiff saves (per `remat` policy) for one
    micro-batch, and the vocabulary chunk of log-prob logits;
  * rollout's transients: the KV cache of the host's rollout rows and one step's logits.
Rollout and training do not overlap in time, so the peak is persistent + the larger transient, plus
the runtime (on CPU, the Python process with JAX and XLA's compiled code, measured by bench/scale.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Sequence

from locojax.model.config import LoRAConfig, ModelConfig, lora_param_count, lora_projection_dims, param_count

RematPolicy = Literal["none", "dots", "full"]
# In the order fit_plan tries them: most memory and fewest FLOPs first.
REMAT_POLICIES: tuple[RematPolicy, ...] = ("none", "dots", "full")
GiB = 1024**3
# What the process needs besides the plan's arrays on CPU: the interpreter with JAX, XLA and the
# compiled executables (bench/scale.py measured ~1.3 GiB RSS before the first parameter existed).
CPU_RUNTIME_BYTES = 1.5 * GiB
# Memory a run may fill: the rest is the runtime's and fragmentation's (as the cost model assumes).
USABLE_FRACTION = 0.9
# Vocabulary columns the train step's log-probs score at once (locojax.train). Full logits of a 0.6B
# batch are rows x slots x 151,936 floats (64 rows x 128 slots: 5 GB in float32, and autodiff keeps
# them for the backward pass); in rematerialised chunks only one chunk's [B, N, C] exists at a time.
LOGPROB_VOCAB_CHUNK = 16384

# With no micro_batch_size set, a step on CPU devices splits each device's rows into micro-batches of
# at most this many token slots (halving while the rows divide evenly). XLA:CPU allocates a step's
# whole temporary buffer afresh on every call and the kernel faults in and zeroes every page of it,
# so past a few thousand rows x slots the faults, not the FLOPs, set the time: 512 rows x 104 slots
# on one core took 680 ms whole, 384 ms as 4 micro-batches and 331 ms as 8 (6.6K slots each);
# 1024 rows 1346 ms whole, 708 ms as 8. Accelerators keep the whole batch (their memory is
# allocated once); set micro_batch_size to bound their activation memory.
CPU_MICRO_BATCH_SLOTS = 8192


def num_micro_batches(batch_size: int, micro_batch_size: int | None, seq_len: int = 0,
                      data_devices: int = 1, platform: str = "") -> int:
    """Micro-batches of one train step on `batch_size` rows split over `data_devices`: the train step
    (locojax.train) takes its count from here, so the plan counts the same ones."""
    if micro_batch_size is None:
        if platform != "cpu":
            return 1
        num, per_device = 1, batch_size // max(data_devices, 1)
        while per_device // num * seq_len > CPU_MICRO_BATCH_SLOTS and per_device % (2 * num) == 0:
            num *= 2
        return num
    if micro_batch_size >= batch_size:
        return 1
    if batch_size % micro_batch_size:
        raise ValueError(f"batch of {batch_size} sequences is not a multiple of micro_batch_size {micro_batch_size}")
    return batch_size // micro_batch_size


# Parameter-sized buffers the train step holds at its peak (gradients, AdamW's update, the backward's
# per-layer buffers), per embedding and per layer parameter; measured, see `plan_memory`.
EMBEDDING_STEP_BUFFERS = 1.5
LAYER_STEP_BUFFERS = 4.25
# With LoRA no weight gets a gradient or an update: the step's buffers are the adapters' (as above, per
# adapter parameter) and what the backward through the frozen layers holds, ~1.5 x their weights
# (compiled memory_analysis of the LoRA train step on CPU, rank 8 on all seven projections, 32 rows x
# 96 slots: small 4 and 8 layers and Qwen3-0.6B dims with 2 layers measured 0.96, 0.90 and 1.02 of the
# plan's train terms, where the full fine-tuning plan measured 0.95, 0.90 and 1.30 of its own).
FROZEN_LAYER_STEP_BUFFERS = 1.5
ADAPTER_BYTES = 4  # adapters are float32 whatever the model's dtype (locojax.model.transformer)

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class MemoryPlanError(ValueError):
    """A run whose plan does not fit the device; the message names the term and what would fit."""


# How every refusal of a run by its memory plan begins (`refusal`, `locojax.compiled_plan`'s XLA
# refusal), which tools reading `locojax train`'s output look for (bench/full_ft.py).
DOES_NOT_FIT = "the run does not fit"


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The per-host training mesh: data x fsdp x tensor devices (RunSpec placement.fsdp/tensor)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def param_shards(self) -> int:
        return self.fsdp * self.tensor

    def label(self) -> str:
        return f"data {self.data} x fsdp {self.fsdp} x tensor {self.tensor}"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of each term; `peak_bytes` is what must fit `capacity_bytes`."""

    persistent: dict[str, float]
    train: dict[str, float]
    rollout: dict[str, float]
    runtime_bytes: float
    mesh: MeshShape
    remat: RematPolicy
    dtype: str
    capacity_bytes: float | None = None
    capacity_name: str = "device memory"
    # The KL reference pass's transient, when it is planned on its own (the compiled plan).
    reference: dict[str, float] = dataclasses.field(default_factory=dict)
    # "analytic": these formulas; "compiled": XLA's memory analysis of the run's programs
    # (locojax.compiled_plan, on accelerators).
    source: str = "analytic"

    @property
    def peak_bytes(self) -> float:
        transients = (sum(self.train.values()), sum(self.rollout.values()), sum(self.reference.values()))
        return sum(self.persistent.values()) + max(transients) + self.runtime_bytes

    @property
    def terms(self) -> dict[str, float]:
        return {**self.persistent, **self.train, **self.rollout, **self.reference, "runtime": self.runtime_bytes}

    @property
    def fits(self) -> bool:
        return self.capacity_bytes is None or self.peak_bytes <= self.capacity_bytes * USABLE_FRACTION

    def largest_term(self) -> tuple[str, float]:
        return max(self.terms.items(), key=lambda item: item[1])

    def summary(self) -> str:
        """One line: the peak, the capacity, every term in GiB."""
        def gib(values: dict[str, float]) -> str:
            return ", ".join(f"{name} {value / GiB:.2f}" for name, value in values.items())

        capacity = ("" if self.capacity_bytes is None else
                    f" of {self.capacity_bytes * USABLE_FRACTION / GiB:.2f} GiB usable {self.capacity_name}")
        reference = f", reference [{gib(self.reference)}]" if self.reference else ""
        source = ", compiled" if self.source == "compiled" else ""
        return (f"memory plan per device ({self.mesh.label()}, {self.dtype}, remat {self.remat}{source}): peak "
                f"{self.peak_bytes / GiB:.2f} GiB{capacity} = persistent [{gib(self.persistent)}] + max(train "
                f"[{gib(self.train)}], rollout [{gib(self.rollout)}]{reference}) + runtime "
                f"{self.runtime_bytes / GiB:.2f} GiB")


def plan_memory(config: ModelConfig, *, rows_per_host: int, prompt_len: int, new_len: int,
                mesh: MeshShape = MeshShape(), dtype: str | None = None, remat: RematPolicy = "none",
                kl_reference: bool = False, micro_batches: int = 1, runtime_bytes: float = 0.0,
                capacity_bytes: float | None = None, capacity_name: str = "device memory") -> MemoryPlan:
    """The plan for a GRPO run of `rows_per_host` sequences (prompts x group size) per host, each
    `prompt_len` + `new_len` slots, training on `mesh` in `micro_batches` micro-batches per step."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")
    dtype = dtype or config.param_dtype
    value_bytes = _BYTES[dtype]
    params = param_count(config)
    adapters = lora_param_count(config)
    shards = mesh.param_shards
    param_bytes = params * value_bytes / shards
    if adapters:
        adapter_bytes = adapters * ADAPTER_BYTES
        persistent = {"params": param_bytes, "adapters": adapter_bytes, "optimizer": 2 * adapter_bytes}
        if kl_reference:
            persistent["reference"] = adapter_bytes  # zeroed adapters beside the same frozen weights
    else:
        persistent = {"params": param_bytes, "optimizer": 2 * param_bytes}
        if kl_reference:
            persistent["reference"] = params * value_bytes
    if shards > 1:
        persistent["rollout_params"] = params * value_bytes

    # Gradients and AdamW's update (micro-batches sum in float32), and the backward pass's buffers as
    # XLA's buffer assignment of this train step reports them (compiled memory_analysis, Qwen3-0.6B
    # dims on CPU, 2 and 8 layers: 1.39 and 2.89 GiB): ~1.5 x the embedding, ~4.25 x the layers.
    grad_value_bytes = max(value_bytes, 4 if micro_batches > 1 else value_bytes)
    embedding = config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
    if adapters:
        grad_bytes = (FROZEN_LAYER_STEP_BUFFERS * (params - embedding) * value_bytes / shards
                      + LAYER_STEP_BUFFERS * adapters * ADAPTER_BYTES)
    else:
        grad_bytes = (EMBEDDING_STEP_BUFFERS * embedding + LAYER_STEP_BUFFERS * (params - embedding)) * grad_value_bytes / shards
    batch_devices = mesh.data * mesh.fsdp
    rows = math.ceil(rows_per_host / batch_devices / micro_batches)  # sequences per device per micro-batch
    seq = prompt_len + new_len
    train = {"gradients": grad_bytes,
             "activations": activation_bytes(config, rows, seq, value_bytes, remat, mesh.tensor),
             "logprob_logits": rows * new_len * min(LOGPROB_VOCAB_CHUNK, config.vocab_size) * 4 * 3 / mesh.tensor}
    # Rollout decodes data-parallel over the host's devices with the whole KV cache per device.
    rollout_rows = math.ceil(rows_per_host / mesh.devices)
    rollout = {"kv_cache": rollout_rows * seq * config.kv_bytes_per_token(value_bytes),
               "sampling_logits": rollout_rows * config.vocab_size * 4 * 3}
    if config.lora is not None and config.lora.rollout == "merged":  # the folded copy of the adapted weights
        dims = lora_projection_dims(config)
        rollout["merged_weights"] = (config.n_layers * value_bytes
                                     * sum(dims[t][0] * dims[t][1] for t in config.lora.targets))
    return MemoryPlan(persistent, train, rollout, runtime_bytes, mesh, remat, dtype, capacity_bytes, capacity_name)


def activation_bytes(config: ModelConfig, rows: int, seq: int, value_bytes: int, remat: RematPolicy,
                     tensor: int = 1) -> float:
    """What the backward pass needs saved from the forward of `rows` sequences of `seq` slots.

    Without remat every layer keeps its residual inputs and norms (4 d), queries, keys and values
    before and after the rotary embedding, the attention output (3 H Dh + 3 K Dh), the SwiGLU's gate,
    up and product (3 F) per token, and the float32 attention scores and probabilities (2 H T).
    With full remat a layer keeps only its input (d per token) and one layer's worth is recomputed
    at a time. With dots it also keeps its weight matmuls' outputs: queries, keys, values, the
    attention and MLP output projections (2 d), gate and up (2 F); again one layer's worth of the rest
    is recomputed at a time."""
    d, f = config.d_model, config.d_ff
    heads, kv, hd = config.n_heads, config.n_kv_heads, config.head_dim
    tokens = rows * seq
    sharded = (3 * heads * hd + 3 * kv * hd + 3 * f) * value_bytes + 2 * heads * seq * 4
    per_layer = tokens * (4 * d * value_bytes + sharded / tensor)
    if remat == "none":
        return config.n_layers * per_layer
    if remat == "dots":
        matmul_outputs = (heads * hd + 2 * kv * hd + 2 * f) / tensor + 2 * d
        return config.n_layers * tokens * (d + matmul_outputs) * value_bytes + per_layer
    return config.n_layers * tokens * d * value_bytes + per_layer


def mesh_shapes(devices_per_host: int) -> list[MeshShape]:
    """Every per-host mesh the engine can build, fewest parameter shards first (then fsdp before tensor)."""
    shapes = []
    for fsdp in range(1, devices_per_host + 1):
        for tensor in range(1, devices_per_host // fsdp + 1):
            if devices_per_host % (fsdp * tensor) == 0:
                shapes.append(MeshShape(devices_per_host // (fsdp * tensor), fsdp, tensor))
    return sorted(shapes, key=lambda s: (s.param_shards, s.tensor))


def fit_plan(config: ModelConfig, *, devices_per_host: int, capacity_bytes: float, capacity_name: str,
             dtypes: Sequence[str], **shape) -> MemoryPlan:
    """The first plan that fits, trying dtypes in order, then meshes with the fewest parameter shards,
    then remat none, dots, full. Raises `MemoryPlanError` naming the largest term of the best attempt
    and what else would fit (more chips per model, bfloat16) when none does."""
    best: MemoryPlan | None = None
    for dtype in dtypes:
        for mesh in mesh_shapes(devices_per_host):
            for remat in REMAT_POLICIES:
                plan = plan_memory(config, mesh=mesh, dtype=dtype, remat=remat, capacity_bytes=capacity_bytes,
                                   capacity_name=capacity_name, **shape)
                if plan.fits:
                    return plan
                if best is None or plan.peak_bytes < best.peak_bytes:
                    best = plan
    assert best is not None
    term, size = best.largest_term()
    why = (" (rollout decodes data-parallel, from a whole copy of the weights on every chip)"
           if term == "rollout_params" else "")
    raise MemoryPlanError(
        f"{config.name} does not fit {devices_per_host} device(s) of {capacity_bytes / GiB:.1f} GiB "
        f"({capacity_name}) per host: even the smallest plan ({best.mesh.label()}, {best.dtype}, remat "
        f"{best.remat}; FSDP, tensor parallelism, remat and {' and '.join(dtypes)} were tried) needs "
        f"{best.peak_bytes / GiB:.1f} GiB per device, the largest term being {term} ({size / GiB:.1f} GiB){why}; "
        f"what would fit: more chips per model (chips with more memory, or more of them per host to shard "
        f"over), fewer rows per host or shorter sequences")


def refusal(plan: MemoryPlan) -> str:
    """Why `plan` does not fit, and what would: FSDP/tensor sharding, remat, bfloat16, smaller batches."""
    term, size = plan.largest_term()
    usable = (plan.capacity_bytes or 0) * USABLE_FRACTION
    hints = []
    if term in ("params", "optimizer", "gradients", "rollout_params", "reference"):
        hints.append("more devices per host with placement.fsdp (shards params, gradients and AdamW state)")
    # The analytic plan names the activations; the compiled one has them among the train step's temporaries.
    activations = plan.train.get("activations", plan.train.get("train_temporaries", 0.0))
    if plan.remat != "full" and activations > 0.1 * plan.peak_bytes:
        hints.append("model.remat: full (keeps one activation per layer)"
                     + ("" if plan.remat == "dots" else " or dots (keeps the weight matmuls' outputs)"))
    if plan.dtype == "float32":
        hints.append("model.dtype: bfloat16 (halves every parameter-sized term)")
    if term == "train_saved_forward":
        hints.append("placement.early_forward: false (the train step's forward and backward in one program, "
                     "which XLA can schedule to hold less)")
    if plan.rollout.get("merged_weights") and sum(plan.rollout.values()) >= sum(plan.train.values()):
        hints.append(f"model.lora.rollout: adapters (no copy of the adapted weights while the rollout runs, "
                     f"{plan.rollout['merged_weights'] / GiB:.2f} GiB)")
    hints.append("fewer rollout.prompts_per_step or group_size, or algo.micro_batch_size")
    return (f"{DOES_NOT_FIT}: {plan.summary()}. The plan needs {plan.peak_bytes / GiB:.2f} GiB per device "
            f"but {usable / GiB:.2f} GiB of {plan.capacity_name} is usable; the largest term is {term} "
            f"({size / GiB:.2f} GiB). What would fit: " + "; ".join(hints) + ".")


def device_capacity(devices) -> tuple[float, str, float]:
    """(bytes one device may use, a name for it, runtime bytes per device) of the local `devices`.

    CPU devices share the host's memory: each gets MemAvailable / (local CPU devices), and the
    process's runtime counts against it. Accelerators report their own limit."""
    devices = list(devices)
    device = devices[0]
    if device.platform == "cpu":
        available = _mem_available_bytes()
        return available / len(devices), "host memory (MemAvailable)", CPU_RUNTIME_BYTES / len(devices)
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return float("inf"), f"{device.platform} memory (unreported)", 0.0
    return float(limit), f"{device.device_kind} memory", 0.0


def _mem_available_bytes() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# ---------------------------------------------------------------------------------------------------
# The engine's side: a RunSpec's plan on the local devices


def spec_model_config(spec) -> ModelConfig:
    """The ModelConfig a RunSpec will build, read without building it (a preset, or a HF config.json),
    with the spec's LoRA adapters."""
    return _spec_base_config(spec).replace(lora=spec_lora_config(spec))


def spec_lora_config(spec) -> LoRAConfig | None:
    """A RunSpec's model.lora as the model's LoRAConfig (None without adapters)."""
    lora = spec.model.lora
    return None if lora is None else LoRAConfig(lora.rank, float(lora.alpha), tuple(lora.targets), lora.rollout)


def _spec_base_config(spec) -> ModelConfig:
    if spec.model.checkpoint:
        import json
        from pathlib import Path

        from locojax.model.hf_config import config_from_hf

        config_file = Path(spec.model.checkpoint) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model.checkpoint: {config_file.parent} holds no config.json (expected a HF "
                                    "directory, e.g. <output_dir>/model of a finished SFT run)")
        return config_from_hf(json.loads(config_file.read_text(encoding="utf-8")), name=config_file.parent.name,
                              dtype=spec.model.dtype)
    from locojax.model.config import get_preset

    return get_preset(spec.model.preset).replace(param_dtype=spec.model.dtype, dtype=spec.model.dtype)


def plan_for_spec(spec, devices, hosts: int, *, samples: bool) -> MemoryPlan:
    """The plan of `spec` on this host's `devices` (one of `hosts` hosts sharing the prompts), against
    their capacity. A run whose mode does not sample (`samples=False`: SFT, `ModeDef.samples`) plans the
    same terms with its batch of reference answers (no rollout groups, no reference policy)."""
    devices = list(devices)
    config = spec_model_config(spec)
    rows_per_host = spec.rollout.prompts_per_step * (spec.rollout.group_size if samples else 1) // max(hosts, 1)
    fsdp, tensor = spec.placement.fsdp, spec.placement.tensor
    if len(devices) % (fsdp * tensor):
        raise ValueError(f"placement.fsdp x placement.tensor ({fsdp} x {tensor}) must divide this host's "
                         f"{len(devices)} devices")
    mesh = MeshShape(len(devices) // (fsdp * tensor), fsdp, tensor)
    seq = spec.rollout.max_prompt_tokens + spec.rollout.max_new_tokens
    micro_batches = num_micro_batches(rows_per_host, spec.algo.micro_batch_size, seq, mesh.data * mesh.fsdp,
                                      devices[0].platform)
    capacity, capacity_name, runtime = device_capacity(devices)
    return plan_memory(config, rows_per_host=rows_per_host, prompt_len=spec.rollout.max_prompt_tokens,
                       new_len=spec.rollout.max_new_tokens, mesh=mesh, dtype=spec.model.dtype,
                       remat=spec.model.remat, kl_reference=samples and spec.algo.kl_coef > 0,
                       micro_batches=micro_batches, runtime_bytes=runtime, capacity_bytes=capacity,
                       capacity_name=capacity_name)


def check_spec_fits(spec, devices, hosts: int, *, samples: bool, echo=None) -> MemoryPlan:
    """Print the plan (to `echo`, default stderr) and raise `MemoryPlanError` if it does not fit."""
    plan = plan_for_spec(spec, devices, hosts, samples=samples)
    if echo is None:
        import sys

        def echo(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    echo(plan.summary())
    if not plan.fits:
        raise MemoryPlanError(refusal(plan))
    return plan
