"""RunSpec: the one description of a run, shared by the CLI, the REST API and the workers.

Validated once at the boundary (pydantic, `extra="forbid"` everywhere so a typo is an error that names
the field), then treated as read-only. `RunSpec.model_json_schema()` is the published JSON Schema.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from locojax.contract import validation_message
from locojax.modes import KIND_MODES, spec_mode

Mode = Literal["co", "da", "sc"]
# Tasks read from a local file (task.path); the others are generated from an index.
FILE_TASKS = ("gsm8k", "math")
Kind = Literal["grpo", "sft"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The projections a LoRA adapter may attach to, by their short names (PEFT's `q_proj` ... `down_proj`).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _known_lora_target(value: str) -> str:
    if value not in LORA_TARGETS:
        raise ValueError(f"unknown target {value!r} (one of {', '.join(LORA_TARGETS)})")
    return value


class LoRASpec(_Strict):
    """Low-rank adapters: only they are trained; the base weights stay frozen (README, "LoRA")."""

    rank: int = Field(8, ge=1, le=65536, strict=True, description="r: the adapters' inner dimension")
    alpha: float = Field(16.0, gt=0.0, le=1e6, description="the low-rank path is scaled by alpha / rank")
    targets: list[Annotated[str, AfterValidator(_known_lora_target)]] = Field(
        default_factory=lambda: ["q", "k", "v", "o"], min_length=1, max_length=len(LORA_TARGETS),
        description=f"projections that get an adapter, among {', '.join(LORA_TARGETS)}")
    rollout: Literal["adapters", "merged"] = Field(
        "adapters",
        description="how rollouts run the adapted model: 'adapters' applies the low-rank path beside each "
        "frozen projection at every decode step; 'merged' folds the adapters into a copy of the adapted weights "
        "once per rollout (one more copy of those weights in memory while it runs; fewer matmuls a decode step, "
        "which saved nothing where decode is bound by reading the weights, as on a TPU v5e at Qwen3-1.7B)")
    init_from: str | None = Field(
        None, max_length=4096,
        description="a saved adapter to start from: a PEFT directory (adapter_config.json + "
        "adapter_model.safetensors, as `export` writes) whose rank and targets match")

    @field_validator("targets")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        repeated = sorted({t for t in value if value.count(t) > 1})
        if repeated:
            raise ValueError(f"target {repeated[0]!r} is listed twice")
        return value


class ModelSpec(_Strict):
    preset: str = Field("tiny", max_length=64, description="a name from locojax.model.PRESETS")
    checkpoint: str | None = Field(
        None, max_length=4096,
        description="local HF directory (config.json + safetensors) or Orbax checkpoint directory to start from",
    )
    tokenizer: str | None = Field(None, max_length=4096, description="local tokenizer.json; default: byte-level")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="parameters and matmul compute (norms and softmax stay float32); float32 on CPU")
    remat: Literal["none", "dots", "full"] = Field(
        "none", description="activation rematerialisation in training: none keeps every layer's activations "
        "for the backward pass, full keeps each layer's input only and recomputes the layer (least memory, "
        "about a third more FLOPs), dots keeps the input and the outputs of the layer's weight matmuls and "
        "recomputes only norms, rotary, attention and activations (between the two in memory, few extra "
        "FLOPs); see locojax.placement.memory")
    scan_layers: Literal["auto"] | bool = Field(
        "auto", description="how the forward runs the decoder layers, whose parameters are stacked either way: "
        "true under one lax.scan (XLA compiles one layer body, not one per layer: far shorter first steps), "
        "false unrolled; auto: unrolled on CPU, where it runs faster, and on accelerators for stacks of at most "
        "4 layers (they compile quickly and run faster unrolled), scanned otherwise")
    lora: LoRASpec | None = Field(
        None, description="train low-rank adapters on a frozen base instead of every weight (GRPO and SFT)")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        from locojax.model.config import PRESETS

        if value.lower() not in PRESETS:
            raise ValueError(f"unknown model preset {value!r}; known: {', '.join(PRESETS)}")
        return value.lower()


class TaskSpec(_Strict):
    name: str = Field("arith", max_length=64)
    path: str | None = Field(None, max_length=4096, description="local JSONL/parquet for gsm8k and math")
    difficulty: int = Field(1, ge=0, le=5, description="generated tasks only; 0 (bare `12+7=` equations) is arith only")
    reward: list[str] | None = Field(None, max_length=8, description="reward functions; default: the task's own")

    @model_validator(mode="after")
    def _path_when_needed(self) -> "TaskSpec":
        if self.name in FILE_TASKS and not self.path:
            raise ValueError(f"task.path is required for task {self.name!r} (a local JSONL or parquet file)")
        if self.difficulty == 0 and self.name != "arith":
            raise ValueError(f"task.difficulty 0 exists for arith only; {self.name!r} starts at 1")
        return self


class RolloutSpec(_Strict):
    prompts_per_step: int = Field(32, ge=1, le=65536,
                                  description="prompts per step (GRPO: each sampled group_size times); "
                                  "SFT: the batch size, examples per step")
    group_size: int = Field(8, ge=1, le=1024)
    max_prompt_tokens: int = Field(128, ge=1, le=32768, description="prompt slots (left-padded, left-truncated)")
    max_new_tokens: int = Field(24, ge=1, le=32768,
                                description="completion slots; SFT: reference + EOS slots (longer ones are cut)")
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 disables top-k")


class AlgoSpec(_Strict):
    name: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    clip_eps: float = Field(0.2, ge=0.0, le=10.0)
    clip_eps_high: float | None = Field(0.28, ge=0.0, le=10.0)
    kl_coef: float = Field(0.0, ge=0.0, le=100.0)
    loss: Literal["grpo"] = Field("grpo", description="the policy loss (locojax.algo.POLICY_LOSSES): grpo, the "
                                  "clipped surrogate plus kl_coef times the k3 KL")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    num_iterations: int = Field(1, ge=1, le=64)
    micro_batch_size: int | None = Field(None, ge=1, le=65536, description=(
        "sequences of the global batch per gradient micro-batch; unset: the whole batch on accelerators, "
        "micro-batches of at most 8192 token slots per device on CPU (locojax.placement.memory.CPU_MICRO_BATCH_SLOTS); "
        "smaller programs can be faster on accelerators too: on a TPU v5e, Qwen3-0.6B bf16's 128 rows of 192 slots "
        "trained in 1.13 s whole and 0.94-0.97 s as micro-batches of 16-32 rows (bench/results/train_variants_tpu.json)"))


class OptimSpec(_Strict):
    lr: float = Field(3e-4, gt=0.0, le=1.0, description="peak AdamW learning rate (GRPO and SFT alike)")
    warmup_steps: int = Field(5, ge=0, le=10_000_000)
    decay: Literal["constant", "cosine"] = Field(
        "constant", description="after warmup; keep SFT warm starts constant (a decayed end leaves a model "
        "that GRPO makes worse)")
    grad_clip: float = Field(1.0, gt=0.0, le=1e6)
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    b1: float = Field(0.9, ge=0.0, lt=1.0)
    b2: float = Field(0.999, ge=0.0, lt=1.0)


class PlacementSpec(_Strict):
    # No address field: a spec never names a network endpoint (DESIGN §4). A DA run's Ray cluster is a
    # private one on its host, or the operator's (`locojax train --ray-address`, LOCOJAX_RAY_ADDRESS).
    mode: Mode = "co"
    hosts: int = Field(1, ge=1, le=4096)
    devices_per_host: int = Field(1, ge=1, le=64)
    rollout_fraction: float | None = Field(None, gt=0.0, lt=1.0, description="DA only: share of hosts doing rollout")
    decision_id: int | None = Field(None, ge=1, description="the placement decision this run follows")
    # The per-host training mesh is data x fsdp x tensor, data taking the devices left over.
    fsdp: int = Field(1, ge=1, le=64, description="devices per host the parameters, gradients and AdamW state "
                      "are sharded over (FSDP); the batch is split over data x fsdp")
    tensor: int = Field(1, ge=1, le=64, description="devices per host each layer's heads, MLP and vocabulary "
                        "are split over (tensor parallelism)")
    early_forward: bool = Field(False, description=(
        "CO: the update's forward pass goes to the chip right after the rollout and runs while the host "
        "scores the rewards; the update then only pulls the loss's gradient back through what it saved (two "
        "programs instead of one, the same numbers). For rewards slower than the forward pass; with fast ones "
        "it measured neutral (TPU v5e, small preset: 30.9 ms a step with it, 31.2 without), the two programs "
        "costing 1.7 ms more device time than one. Needs one process, algo.num_iterations 1 and the batch "
        "in one micro-batch. An accelerator's compiled memory plan counts what the forward saves; the CPU's "
        "analytic plan does not"))

    @model_validator(mode="after")
    def _mesh_fits_host(self) -> "PlacementSpec":
        if self.devices_per_host % (self.fsdp * self.tensor):
            raise ValueError(f"placement.fsdp x placement.tensor ({self.fsdp} x {self.tensor}) must divide "
                             f"placement.devices_per_host ({self.devices_per_host}); the rest is data parallel")
        return self

    @model_validator(mode="after")
    def _fits_mode(self) -> "PlacementSpec":
        from locojax.modes import MODES

        mode = MODES.get(self.mode)
        error = mode.validate_placement(self)
        if error:
            raise ValueError(error)
        if self.rollout_fraction is not None and not mode.rollout_groups:
            raise ValueError("placement.rollout_fraction only applies to mode 'da'")
        if self.early_forward and not mode.early_forward:
            raise ValueError(f"placement.early_forward does not apply to mode '{self.mode}'")
        return self

    @property
    def rollout_hosts(self) -> int:
        """DA only: hosts in the rollout group."""
        return round(self.hosts * (self.rollout_fraction if self.rollout_fraction is not None else 0.5))


class CheckpointSpec(_Strict):
    every: int = Field(25, ge=0, le=10_000_000, description="0 disables periodic checkpoints")
    keep: int = Field(3, ge=1, le=100)
    dir: str | None = Field(None, max_length=4096, description="default: <output_dir>/checkpoints")


class EvalSpec(_Strict):
    """Held-out evaluation during training (CO GRPO runs) and by `locojax eval`.

    The held-out prompts are never trained on: for generated tasks they come from indices past the
    task's training range, for file tasks from `path` or a seeded share of `task.path`, and in both
    cases a training example whose prompt text equals a held-out prompt is skipped
    (`locojax.tasks.held_out`).
    """

    every: int = Field(20, ge=0, le=10_000_000, description=(
        "evaluate at the start of every N-th step (step 0 included) and after the last step; "
        "0: only before the first and after the last step"))
    prompts: int = Field(64, ge=1, le=65536, description="held-out prompts per evaluation (at most the file's)")
    k: int = Field(4, ge=1, le=1024, description="samples per prompt for eval/pass@k")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="sampling temperature of the pass@k samples "
                               "(eval/accuracy is greedy)")
    reward: list[str] | None = Field(None, max_length=8, description=(
        "the rewards that decide correctness (a completion is right when each gives full credit, 1.0); "
        "default: the task's own, not task.reward (training rewards may add shaping)"))
    path: str | None = Field(None, max_length=4096, description=(
        "file tasks only: a held-out JSONL/parquet in task.path's format (e.g. GSM8K's test split); "
        "default: a seeded share of task.path held out from training"))


class DebugSpec(_Strict):
    """Checks for tests and debugging, off by default: they cost time inside the step."""

    checksum_every: int = Field(0, ge=0, le=10_000_000, description=(
        "report params/checksum, a device-side fingerprint of each host's parameters, at every N-th step "
        "(step 0 included); 0: never"))


class RunSpec(_Strict):
    name: str = Field("run", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    kind: Kind = Field(
        "grpo",
        description="grpo: RL in the placement's mode. sft: a teacher-forced warm start on the task's reference "
        "answers, single host (placement.hosts 1, data parallel over its devices); batch size "
        "rollout.prompts_per_step, learning rate optim.*, prompt/reference slots rollout.max_prompt_tokens/"
        "max_new_tokens; it exports <output_dir>/model, a directory a GRPO spec's model.checkpoint can name",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1)
    model: ModelSpec = ModelSpec()
    task: TaskSpec = TaskSpec()
    rollout: RolloutSpec = RolloutSpec()
    algo: AlgoSpec = AlgoSpec()
    optim: OptimSpec = OptimSpec()
    steps: int = Field(200, ge=1, le=10_000_000)
    placement: PlacementSpec = PlacementSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    output_dir: str | None = Field(None, max_length=4096, description="default: runs/<name>")
    max_restarts: int = Field(2, ge=0, le=10)
    eval: EvalSpec | None = Field(None, description="held-out evaluation; GRPO runs in CO mode only")
    debug: DebugSpec = DebugSpec()

    @model_validator(mode="after")
    def _eval_where_supported(self) -> "RunSpec":
        if self.eval is None:
            return self
        # SC and DA would need their own shard plumbing; one mode that evaluates honestly beats three.
        if not spec_mode(self).evaluates:
            raise ValueError(f"eval applies to GRPO runs in CO mode only (this spec: kind {self.kind!r}, "
                             f"placement.mode {self.placement.mode!r}); remove the eval block or use "
                             "`locojax eval SPEC --checkpoint DIR` on a saved model")
        if self.eval.prompts % self.placement.hosts:
            raise ValueError(f"eval.prompts ({self.eval.prompts}) must be divisible by placement.hosts "
                             f"({self.placement.hosts}): every host evaluates an equal shard")
        if self.eval.path is not None and self.task.name not in FILE_TASKS:
            raise ValueError(f"eval.path applies to file tasks ({', '.join(FILE_TASKS)}); task {self.task.name!r} "
                             "is generated and holds its evaluation prompts out by index")
        return self

    @model_validator(mode="after")
    def _batch_divides(self) -> "RunSpec":
        mode = spec_mode(self)
        error = mode.validate(self)
        if error:
            raise ValueError(error)
        if mode.name in KIND_MODES.values():
            return self  # a kind of its own (SFT) has no rollout groups to place
        hosts = mode.rollout_hosts(self.placement)
        if self.rollout.prompts_per_step % hosts:
            raise ValueError(
                f"rollout.prompts_per_step ({self.rollout.prompts_per_step}) must be divisible by the "
                f"{hosts} host(s) that do rollout, so every group lives on one host"
            )
        return self

    def digest(self) -> str:
        """Stable hash of the normalised spec (idempotency keys compare these)."""
        body = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()


class SpecError(ValueError):
    """A spec that failed validation; `errors` lists (field path, message) pairs. An error of the whole
    spec (a check across its blocks) has the empty path and is shown as `spec`, the name the API's
    error details give it (`spec.<path>` for the others)."""

    def __init__(self, errors: list[tuple[str, str]], source: str = "spec"):
        self.errors = errors
        lines = "; ".join(f"{_shown_path(path) or 'spec'}: {msg}" for path, msg in errors)
        super().__init__(f"invalid {source}: {lines}")


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


def _shown_path(path: str) -> str:
    """A field path as the message shows it: list positions in brackets (`model.lora.targets[2]`; the
    `errors` list and the API keep the dotted form, `model.lora.targets.2`)."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", path)


def parse_spec(data: Any, source: str = "spec") -> RunSpec:
    """Validate a mapping into a RunSpec, turning pydantic's errors into `SpecError` naming field paths."""
    if not isinstance(data, dict):
        raise SpecError([("", f"expected a mapping at the top level, got {type(data).__name__}")], source)
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        errors = [(_field_path(err["loc"]), validation_message(err)) for err in exc.errors()]
        raise SpecError(errors, source) from None


def load_spec(path: str | Path) -> RunSpec:
    """Read a YAML (or JSON) spec file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([("", f"file not found: {path}")], str(path)) from None
    except UnicodeDecodeError as exc:
        raise SpecError([("", f"not UTF-8 text ({exc.reason} at byte {exc.start})")], str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError([("", f"not valid YAML: {exc}")], str(path)) from None
    return parse_spec(data, str(path))


def dump_spec(spec: RunSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
