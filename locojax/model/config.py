"""Model configuration: one frozen dataclass, presets by name, and the analytic parameter count.

The presets double as the placement catalog (locojax.placement reads `PRESETS`), so a model's
dimensions are written down exactly once. Dimensions of the public models are from
shared/reference/FACTS.md (MaxText `configs/models/*.yml`, model cards).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Architecture = Literal["qwen3", "llama"]
DTypeName = Literal["float32", "bfloat16", "float16"]
ScanLayers = Literal["auto"] | bool
LoRARollout = Literal["adapters", "merged"]
LORA_ROLLOUTS = ("adapters", "merged")

# What `scan_layers: auto` picks per JAX platform (`jax.default_backend()`). XLA:CPU runs the unrolled
# layers faster (README, "The model"). On accelerators the compile time of one layer body instead of N is
# the point, but a short stack compiles quickly either way and runs faster unrolled: on a TPU v5e the
# 4-layer small preset's GRPO step at size b took 115-118 ms unrolled against 152 ms scanned, alternating
# in one session (bench/results/scan_layers_ab_tpu.json; rollout 56 vs 72 ms, train 52 vs 76),
# for ~9 s more compilation; Qwen3-0.6B's 28 unrolled layers took 2-2.5 minutes to a first step where
# the scanned stack takes under 30 s. So a platform not named here scans stacks deeper than this.
SCAN_LAYERS_AUTO: dict[str, bool] = {"cpu": False}
UNROLLED_LAYERS_MAX = 4


# Projection short names (as in RunSpec model.lora.targets) -> the Hugging Face / PEFT module path.
LORA_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the named projections: W x + (alpha / rank) B A x, A [rank, in], B [out, rank].

    `rollout`: how a rollout runs the adapted model. "adapters": the low-rank path beside every frozen
    projection, on every decode step (no extra memory). "merged": each rollout first folds the adapters
    into a copy of the adapted weights (W + scale B A, once per rollout) and decodes on that copy, as a
    model without adapters; it costs one copy of those weights for the rollout's duration."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rollout: LoRARollout = "adapters"

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0:
            raise ValueError(f"LoRAConfig needs rank >= 1 and alpha > 0, got rank={self.rank}, alpha={self.alpha}")
        unknown = [t for t in self.targets if t not in LORA_MODULES]
        if unknown or not self.targets:
            raise ValueError(f"LoRAConfig.targets must be among {', '.join(LORA_MODULES)}, got {self.targets}")
        if self.rollout not in LORA_ROLLOUTS:
            raise ValueError(f"LoRAConfig.rollout must be one of {', '.join(LORA_ROLLOUTS)}, got {self.rollout!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a Qwen3-architecture (or Llama-3.1) decoder.

    `qk_norm` is what separates Qwen3 from Llama-3.1: an RMSNorm over head_dim on queries and keys
    before the rotary embedding.
    """

    name: str
    arch: Architecture
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    qk_norm: bool
    max_seq_len: int = 4096
    param_dtype: DTypeName = "float32"
    dtype: DTypeName = "float32"  # compute dtype of matmuls; norms and softmax stay float32
    # How the forward iterates the (always stacked) layers: under one `lax.scan` (XLA compiles one
    # layer body) or unrolled; "auto" decides per platform (`SCAN_LAYERS_AUTO`).
    scan_layers: ScanLayers = "auto"
    lora: LoRAConfig | None = None  # adapters on top of the (then frozen) weights

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.scan_layers not in ("auto", True, False):
            raise ValueError(f"ModelConfig.scan_layers must be 'auto', True or False, got {self.scan_layers!r}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def scans_layers(self, platform: str) -> bool:
        """Whether the forward runs the layers under `lax.scan` on `platform` (a JAX backend name)."""
        if self.scan_layers == "auto":
            return SCAN_LAYERS_AUTO.get(platform, self.n_layers > UNROLLED_LAYERS_MAX)
        return bool(self.scan_layers)

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes per token of one sequence: 2 (k and v) * bytes * kv_heads * head_dim * layers."""
        return 2 * bytes_per_value * self.n_kv_heads * self.head_dim * self.n_layers


def lora_projection_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target."""
    d, hd = config.d_model, config.head_dim
    return {"q": (d, config.n_heads * hd), "k": (d, config.n_kv_heads * hd), "v": (d, config.n_kv_heads * hd),
            "o": (config.n_heads * hd, d), "gate": (d, config.d_ff), "up": (d, config.d_ff),
            "down": (config.d_ff, d)}


def lora_param_count(config: ModelConfig) -> int:
    """Adapter parameters of `config.lora` (0 without): rank * (in + out) per targeted projection and layer."""
    if config.lora is None:
        return 0
    dims = lora_projection_dims(config)
    return config.n_layers * config.lora.rank * sum(sum(dims[t]) for t in config.lora.targets)


def param_count(config: ModelConfig) -> int:
    """Exact number of parameters of the decoder `locojax.model.Transformer(config)` builds."""
    d, hd = config.d_model, config.head_dim
    attention = d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2  # q, o, k, v
    mlp = 3 * d * config.d_ff  # gate, up, down
    norms = 2 * d + (2 * hd if config.qk_norm else 0)
    per_layer = attention + mlp + norms
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return embeddings + config.n_layers * per_layer + d  # + final norm (adapters: `lora_param_count`)


# Byte-level tokenizer vocabulary (256 bytes + BOS/EOS/PAD) padded up to a multiple of 128 so the
# output projection tiles evenly.
BYTE_VOCAB = 384

_QWEN3 = dict(arch="qwen3", vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True)
_LLAMA31 = dict(arch="llama", vocab_size=128256, head_dim=128, rope_theta=500_000.0, norm_eps=1e-5, qk_norm=False,
                tie_embeddings=False)

PRESETS: dict[str, ModelConfig] = {
    # Unit-test size: compiles in well under a second.
    "tiny": ModelConfig(name="tiny", arch="qwen3", vocab_size=BYTE_VOCAB, d_model=64, n_layers=2, n_heads=4,
                        n_kv_heads=2, head_dim=16, d_ff=128, rope_theta=10_000.0, norm_eps=1e-6,
                        tie_embeddings=True, qk_norm=True, max_seq_len=512),
    # The benchmark size (issue 2): d_model 256, 4 layers, 4 heads, 4 kv heads, head_dim 64, d_ff 1024.
    "small": ModelConfig(name="small", arch="qwen3", vocab_size=BYTE_VOCAB, d_model=256, n_layers=4, n_heads=4,
                         n_kv_heads=4, head_dim=64, d_ff=1024, rope_theta=10_000.0, norm_eps=1e-6,
                         tie_embeddings=True, qk_norm=True, max_seq_len=1024),
    # FACTS.md, "Models" table (MaxText configs/models/qwen3-*.yml, Qwen3 model cards).
    "qwen3-0.6b": ModelConfig(name="qwen3-0.6b", d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, d_ff=3072,
                              tie_embeddings=True, max_seq_len=40960, **_QWEN3),
    "qwen3-1.7b": ModelConfig(name="qwen3-1.7b", d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8, d_ff=6144,
                              tie_embeddings=True, max_seq_len=40960, **_QWEN3),
    "qwen3-4b": ModelConfig(name="qwen3-4b", d_model=2560, n_layers=36, n_heads=32, n_kv_heads=8, d_ff=9728,
                            tie_embeddings=True, max_seq_len=40960, **_QWEN3),
    "qwen3-8b": ModelConfig(name="qwen3-8b", d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, d_ff=12288,
                            tie_embeddings=False, max_seq_len=40960, **_QWEN3),
    "qwen3-14b": ModelConfig(name="qwen3-14b", d_model=5120, n_layers=40, n_heads=40, n_kv_heads=8, d_ff=17408,
                             tie_embeddings=False, max_seq_len=40960, **_QWEN3),
    "qwen3-32b": ModelConfig(name="qwen3-32b", d_model=5120, n_layers=64, n_heads=64, n_kv_heads=8, d_ff=25600,
                             tie_embeddings=False, max_seq_len=40960, **_QWEN3),
    # FACTS.md (MaxText configs/models/llama3.1-*.yml, Llama-3.1 model cards).
    "llama-3.1-8b": ModelConfig(name="llama-3.1-8b", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                d_ff=14336, max_seq_len=131072, **_LLAMA31),
    "llama-3.1-70b": ModelConfig(name="llama-3.1-70b", d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                 d_ff=28672, max_seq_len=131072, **_LLAMA31),
    "llama-3.1-405b": ModelConfig(name="llama-3.1-405b", d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                  d_ff=53248, max_seq_len=131072, **_LLAMA31),
}

# Published parameter counts (FACTS.md), used by the tests and shown in the catalog.
PUBLISHED_PARAMS: dict[str, float] = {
    "qwen3-0.6b": 0.596e9, "qwen3-1.7b": 1.721e9, "qwen3-4b": 4.022e9, "qwen3-8b": 8.191e9,
    "qwen3-14b": 14.77e9, "qwen3-32b": 32.76e9, "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9,
    "llama-3.1-405b": 405.85e9,
}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name` (case-insensitive); a clear error listing the known names otherwise."""
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]
