"""Hardware profiles for the placement cost model, registered by name in `HARDWARE`.

A profile holds everything the step-time model needs to know about one kind of accelerator and the
hosts it sits in: per-chip compute and memory (the roofline), the interconnects (ICI/NVLink inside an
ICI domain, DCN between hosts, PCIe between a chip and its host), and the host-orchestration constants
that separate the three coordination modes. Accelerator numbers come from shared/reference/FACTS.md
(the source is named next to each); host-orchestration numbers come from the Pathways paper and the
sglang-jax proxy measurements quoted there, or are marked as assumptions; the assumptions that were
tuned so that the model reproduces the paper's findings are listed in `cost_model.FITTED_KNOBS` (with
how far each may move: `findings.sensitivity`). Measured runs refine the
host and network constants (`locojax.placement.calibration`), and `locojax probe` measures the
`local-cpu` profile on this machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

from locojax.registry import Registry

GB = 1e9
GiB = 2**30
Gbps = 1e9 / 8  # bytes per second in one gigabit per second

# Pathways (arXiv 2203.12533, section 5.1, quoted in FACTS.md): a single controller matches
# multi-controller throughput only when each computation lasts >= 2.3 ms on 16 hosts or >= 35 ms on
# 512 hosts, i.e. that is what one controller round trip costs. A straight line through the two points:
#   round_trip(hosts) = 1.25 ms + 0.0659 ms * hosts.
PATHWAYS_ROUND_TRIP_PER_HOST_S = (35e-3 - 2.3e-3) / (512 - 16)
PATHWAYS_ROUND_TRIP_BASE_S = 2.3e-3 - 16 * PATHWAYS_ROUND_TRIP_PER_HOST_S

# Host-local dispatch and sync of one computation in multi-controller JAX: dispatch itself is a few
# microseconds (PITFALLS.md: jax.jit over split state ~5 us); a blocking fetch of a small result
# adds a device-to-host round trip. Assumption: 50 us in total on TPU/GPU hosts.
NATIVE_DISPATCH_S = 50e-6

# Serving-style rollout engines on TPU/GPU (vLLM-TPU, sglang-jax) return to the host between decode
# steps to schedule and check stop conditions; sglang-jax issue #772 (FACTS.md) shows that this
# per-step host round trip is what the Pathways proxy slows down (44% of native decode speed), i.e.
# the "short computations repeatedly invoked" of the paper's abstract. Assumption: the host is
# consulted every 4 decode steps.
SERVING_DECODE_TOKENS_PER_DISPATCH = 4

# Ray actor method call with a small payload, as the DA driver makes a few per step.
# Assumption (order of magnitude of Ray's documented task overhead): 1 ms.
RAY_CALL_S = 1e-3

# DCN round-trip latency between hosts in one data centre. Assumption: 20 us.
DCN_LATENCY_S = 20e-6

# scaling-book (FACTS.md, "Other constants"): ICI hop latency ~1 us; PCIe ~15 GB/s per chip.
ICI_HOP_LATENCY_S = 1e-6
PCIE_BANDWIDTH = 15 * GB


# The fields a per-width entry of `HardwareProfile.measured_rates` may set.
RATE_FIELDS = ("peak_flops", "train_mfu", "decode_mfu", "prefill_mfu", "train_attention_efficiency",
               "decode_attention_efficiency", "decode_row_overhead_s", "decode_step_overhead_s",
               "decode_layer_overhead_s", "decode_vocab_overhead_s", "train_step_overhead_s",
               "train_scored_token_overhead_s", "train_vocab_overhead_s",
               "train_layer_activation_s")


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator kind and its hosts. All rates are per chip unless the name says otherwise.

    `shared_machine` marks the local CPU profile: every simulated chip runs on the same cores, so
    the machine's FLOP/s and memory bandwidth are divided among the chips a run uses.
    """

    name: str
    description: str
    peak_flops: float  # dense bf16 FLOP/s per chip (float32 for local-cpu)
    hbm_bytes: float  # accelerator memory per chip
    hbm_bandwidth: float  # bytes/s per chip
    ici_bandwidth: float  # bytes/s per chip inside an ICI (or NVLink) domain, both directions
    ici_domain_chips: int  # chips reachable over ICI/NVLink; beyond them collectives cross DCN
    dcn_bandwidth_per_chip: float  # bytes/s of host network per chip (a host has chips_per_host times this)
    chips_per_host: int
    train_mfu: float  # model FLOP utilisation of a training (and prefill) step, for wide models
    ici_latency_s: float = ICI_HOP_LATENCY_S
    dcn_latency_s: float = DCN_LATENCY_S
    pcie_bandwidth: float = PCIE_BANDWIDTH  # chip <-> host memory, bytes/s per chip
    bytes_per_value: int = 2  # rollout weights and KV cache in bf16 (float32 on local-cpu)
    # Bytes per weight a decode step reads when the weights are stored wider than this: None, the
    # stored width. TPUs multiply float32 at JAX's default precision in one bfloat16 pass, and weights
    # that stay fixed over the whole decode loop reach the matrix unit converted once, not read at four
    # bytes per step: on a v5e the float32 calibration runs decode faster than reading their float32
    # weights once a step at the chip's datasheet bandwidth could (bench/results/placement_tpu.json,
    # round 4). The KV cache, written every step, is read at the stored width.
    decode_weight_bytes_per_value: int | None = None
    # Training FLOPs per parameter per token. Accelerators: full rematerialisation (8 N, FACTS.md
    # "training FLOPs") plus a pass recomputing the behaviour policy's log-probs (2 N).
    train_flops_per_param_token: float = 10.0
    # Fixed device time per decode step and per training step, whatever the model size: loop and
    # kernel-launch overhead that dominates tiny models on a CPU. Accelerators: assumed 0 (XLA fuses a
    # step into few large kernels); `locojax probe` measures them for local-cpu.
    decode_step_overhead_s: float = 0.0
    train_step_overhead_s: float = 0.0
    # Fixed device time per decoder layer per decode step (and once per prefill): the launch and
    # pipeline latency of each layer's fused kernels, which a step of a small model on an accelerator
    # is mostly made of, and which grows with the layers, not with the bytes. Assumed 0 until
    # calibration fits it from a profile's observations (`locojax.placement.calibration`).
    decode_layer_overhead_s: float = 0.0
    # Device time per sequence per vocabulary entry per decode step: sampling reads, normalises and
    # draws from a whole row of logits, so a 152k-entry vocabulary costs 400x a byte-level one. 0 until
    # calibration fits it (`decode_row_overhead_s` is the probe's fixed per-sequence figure on a CPU).
    decode_vocab_overhead_s: float = 0.0
    # Device time per scored (completion) slot of a training step beyond its matmuls: log-softmax
    # and entropy over the vocabulary, the taken token's log-prob, the last layer's work for those
    # slots; per device while every device is busy. 0 on accelerators, where it hides under the
    # matmuls; `locojax probe` measures it for local-cpu. (Per-slot work that is not a matmul has no
    # field of its own: it scales with the slots exactly as the body's matmul FLOPs do, so a fit
    # cannot tell the two apart, and the matmul rate carries both. That holds at one vocabulary size
    # only: the part that grows with the vocabulary is `train_vocab_overhead_s`.)
    train_scored_token_overhead_s: float = 0.0
    # Device time per scored slot per vocabulary entry of a training step beyond the head's matmul:
    # the online log-sum-exp and entropy over every [slot, vocabulary] float32 logit (locojax.train's
    # chunked_logprobs_and_entropy, forward and backward), elementwise work that a byte-level
    # vocabulary makes negligible and Qwen3's 151,936 entries do not. 0 until calibration fits it from
    # runs at two vocabulary sizes (one size cannot tell it from the per-slot and matmul costs); the
    # local CPU's probe counts its 384-entry share in `train_scored_token_overhead_s`.
    train_vocab_overhead_s: float = 0.0
    # Device time per decoder layer per token per unit of width (d_model) of a training step beyond
    # its matmuls: the memory-bound elementwise passes over every layer's activations (norms, the
    # residual adds, SiLU x gate, rotary and qk-norm, the softmax over each head's scores), forward,
    # rematerialised forward and backward. It grows as layers x tokens x width, the matmuls as
    # layers x tokens x width^2, so a small model's step hides it under per-token costs and a deep one
    # (Qwen3-0.6B: 28 layers against the small preset's 4) does not. 0 until calibration fits it from
    # runs of two depths (`DeviceConstant.varies_with`).
    train_layer_activation_s: float = 0.0
    # Published MFU figures are for models at least this wide (Llama-3.1-8B, d_model 4096). Narrower
    # models are assumed to reach proportionally less (`train_mfu * d_model / mfu_reference_width`):
    # the per-token work that is not a large matmul (norms, activations, softmax, collective
    # latency) shrinks only linearly with width while matmul FLOPs shrink quadratically. Assumption,
    # no published small-model MFU; None switches it off.
    mfu_reference_width: int | None = 4096
    # Host orchestration (the constants calibration refits from measured runs).
    dispatch_s: float = NATIVE_DISPATCH_S  # one host-local dispatch + sync (CO, DA)
    controller_round_trip_s: float = PATHWAYS_ROUND_TRIP_BASE_S  # SC: one controller round trip ...
    controller_round_trip_per_host_s: float = PATHWAYS_ROUND_TRIP_PER_HOST_S  # ... plus this per host
    reward_cpu_scale: float = 1.0  # host CPU time of a reward relative to the workload's reference figure
    ray_call_s: float = RAY_CALL_S  # DA: one driver -> actor call
    decode_tokens_per_dispatch: int | None = SERVING_DECODE_TOKENS_PER_DISPATCH  # None: one loop per rollout
    # How much KV cache a decode step reads: "ragged" (paged attention in serving engines: only the
    # tokens each still-running sequence holds) or "dense" (static-shape JAX decode attends every
    # cache slot under a mask, as locojax.rollout does).
    decode_attention: str = "ragged"
    shared_machine: bool = False
    # A shared machine's cores, which every simulated host's CPU work (scoring, detokenising) shares:
    # with more hosts busy at once than cores, each host's CPU work runs at cores/hosts of one core.
    # None: each host has CPUs of its own (every real cluster).
    machine_cores: int | None = None
    # --- CPU-style device terms (all neutral on accelerators, where the roofline above is the model) ---
    # Decode's parameter matmuls run at `decode_mfu * peak_flops` (1: the roofline's compute bound).
    decode_mfu: float = 1.0
    # Prefill (a forward pass over the prompts) runs at `prefill_mfu * peak_flops`; None: the training
    # MFU (as on accelerators, where both are large matmuls).
    prefill_mfu: float | None = None
    # Attention FLOPs (scores, softmax, weighted values over the cache) run at this fraction of the
    # matmul rate of the same kernel: 1 on accelerators (fused attention kernels); far below 1 on a CPU
    # at small head_dim, where the softmax and masking are memory-bound elementwise work.
    train_attention_efficiency: float = 1.0  # training and prefill
    decode_attention_efficiency: float = 1.0
    # Device time per sequence per decode step that is not a matmul: sampling over the vocabulary
    # (per-row RNG, softmax), the cache write, masks. 0 on accelerators (hidden under the weight read).
    decode_row_overhead_s: float = 0.0
    # True when the rates were measured on the engine's own kernels (`locojax probe`): memory traffic
    # is already inside them, so decode is not additionally bounded by weights + KV over bandwidth.
    rates_include_memory: bool = False
    # Measured per-width rates: {str(d_model): {field: value}} for the rate fields above (and
    # peak_flops, train_mfu, the step overheads). A model takes the entry of the nearest width (in
    # log scale). Every mode's processes, SC's workers included, own one pinned core's device each, so
    # one table serves them all.
    measured_rates: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    # How much slower than its measured rates the machine runs now: other work competing for its cores
    # (`locojax.placement.probe.contention`). Device times are multiplied by it, and on a shared machine
    # host and loopback-network times too (the same cores). 1 for a machine of one's own.
    device_time_scale: float = 1.0
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # What JAX calls these devices (`jax.Device.device_kind`), lower case; a trailing `*` matches any
    # suffix ("nvidia h100*": "NVIDIA H100 80GB HBM3"). `hardware_for_device` maps a device to its profile.
    jax_device_kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        positive = ("peak_flops", "hbm_bytes", "hbm_bandwidth", "ici_bandwidth", "dcn_bandwidth_per_chip",
                    "pcie_bandwidth", "train_mfu", "ici_domain_chips", "chips_per_host", "bytes_per_value",
                    "train_flops_per_param_token", "decode_mfu", "train_attention_efficiency",
                    "decode_attention_efficiency", "device_time_scale")
        for field in positive:
            if not getattr(self, field) > 0:
                raise ValueError(f"HardwareProfile.{field} must be positive, got {getattr(self, field)}")
        non_negative = ("ici_latency_s", "dcn_latency_s", "dispatch_s", "controller_round_trip_s",
                        "controller_round_trip_per_host_s", "reward_cpu_scale", "ray_call_s",
                        "decode_step_overhead_s", "train_step_overhead_s", "decode_row_overhead_s",
                        "decode_layer_overhead_s", "decode_vocab_overhead_s", "train_scored_token_overhead_s",
                        "train_vocab_overhead_s", "train_layer_activation_s")
        for field in non_negative:
            if getattr(self, field) < 0:
                raise ValueError(f"HardwareProfile.{field} must not be negative, got {getattr(self, field)}")
        if self.decode_weight_bytes_per_value is not None and self.decode_weight_bytes_per_value < 1:
            raise ValueError("HardwareProfile.decode_weight_bytes_per_value must be positive or None, "
                             f"got {self.decode_weight_bytes_per_value}")
        if self.machine_cores is not None and self.machine_cores < 1:
            raise ValueError(f"HardwareProfile.machine_cores must be at least 1, got {self.machine_cores}")
        if self.prefill_mfu is not None and not 0 < self.prefill_mfu <= 1:
            raise ValueError(f"HardwareProfile.prefill_mfu must be in (0, 1], got {self.prefill_mfu}")
        for field in ("train_mfu", "decode_mfu", "train_attention_efficiency", "decode_attention_efficiency"):
            if getattr(self, field) > 1:
                raise ValueError(f"HardwareProfile.{field} must be at most 1, got {getattr(self, field)}")
        for width, rates in self.measured_rates.items():
            if not str(width).isdigit():
                raise ValueError(f"HardwareProfile.measured_rates: keys are model widths (d_model), got {width!r}")
            unknown = sorted(set(rates) - set(RATE_FIELDS))
            if unknown:
                raise ValueError(f"HardwareProfile.measured_rates[{width}]: not rate fields: {', '.join(unknown)}")
        if self.decode_attention not in ("ragged", "dense"):
            raise ValueError(f"HardwareProfile.decode_attention must be 'ragged' or 'dense', got {self.decode_attention!r}")
        if self.decode_tokens_per_dispatch is not None and self.decode_tokens_per_dispatch < 1:
            raise ValueError("HardwareProfile.decode_tokens_per_dispatch must be >= 1 or None")
        object.__setattr__(self, "jax_device_kinds", tuple(kind.lower() for kind in self.jax_device_kinds))

    def replace(self, **changes: Any) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)

    def rates_for(self, d_model: int) -> "HardwareProfile":
        """This profile with the measured rates of the nearest width applied (itself when none are)."""
        table = self.measured_rates
        if not table:
            return self
        width = min(table, key=lambda key: abs(math.log(int(key) / d_model)))
        return dataclasses.replace(self, **table[width])

    @property
    def dcn_bandwidth_per_host(self) -> float:
        return self.dcn_bandwidth_per_chip * self.chips_per_host

    @property
    def critical_batch(self) -> float:
        """Decode batch above which a step is compute-bound: FLOP/s over bytes/s (FACTS.md formulas)."""
        return self.peak_flops / self.hbm_bandwidth

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["sources"] = dict(self.sources)
        data["jax_device_kinds"] = list(self.jax_device_kinds)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "HardwareProfile":
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hardware profile field(s): {', '.join(unknown)}")
        return cls(**{key: value for key, value in data.items()})


HARDWARE: Registry[HardwareProfile] = Registry("hardware profile")

# Constants measured on the hardware itself, each citing the benchmark JSON it came from (a `source`
# per constant): {profile: {field: {"value": v, "source": "bench/results/<file>.json#<dotted.key>"}}}.
# They replace the documented figures of the profiles below as those are registered; a test checks that
# each cited file holds the value at that key.
MEASURED_CONSTANTS_FILE = Path(__file__).with_name("measured_constants.json")
MEASURED_SOURCE = re.compile(r"^bench/results/[\w.-]+\.json#[\w@.-]+(\.[\w@.-]+)*$")


def read_measured_constants(path: Path = MEASURED_CONSTANTS_FILE) -> dict[str, dict[str, dict[str, Any]]]:
    """The measured-constants table, checked: known profile fields, numeric values, cited sources."""
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of profiles")
    fields = {field.name for field in dataclasses.fields(HardwareProfile)} - {"name", "description", "sources"}
    for profile, constants in data.items():
        if not isinstance(constants, dict):
            raise ValueError(f"{path}: {profile}: expected an object of constants")
        for field, entry in constants.items():
            where = f"{path}: {profile}.{field}"
            if field not in fields:
                raise ValueError(f"{where}: not a hardware profile field")
            if not isinstance(entry, dict) or set(entry) != {"value", "source"}:
                raise ValueError(f"{where}: expected {{\"value\": ..., \"source\": ...}}")
            if not isinstance(entry["value"], (int, float)) or isinstance(entry["value"], bool):
                raise ValueError(f"{where}: value must be a number")
            if not isinstance(entry["source"], str) or not MEASURED_SOURCE.match(entry["source"]):
                raise ValueError(f"{where}: source must cite bench/results/<file>.json#<key>, got {entry['source']!r}")
    return data


def apply_measured_constants(profile: HardwareProfile, table: Mapping[str, Mapping[str, Mapping[str, Any]]]
                             ) -> HardwareProfile:
    """`profile` with its measured constants from `table` (`read_measured_constants`), each source noted."""
    measured = table.get(profile.name) or {}
    if not measured:
        return profile
    return profile.replace(**{field: entry["value"] for field, entry in measured.items()},
                           sources={**profile.sources, **{field: entry["source"] for field, entry in measured.items()}})


_MEASURED = read_measured_constants()


def _add(profile: HardwareProfile) -> HardwareProfile:
    return HARDWARE.register(profile.name)(apply_measured_constants(profile, _MEASURED))


def hardware_for_device(device_kind: str, platform: str | None = None) -> str | None:
    """The catalog profile of a JAX device (`device.device_kind`, `device.platform`): "TPU v5 lite" is
    `tpu-v5e`, any CPU the `local-cpu` profile; None when no profile describes it."""
    kind = "cpu" if (platform or "").lower() == "cpu" else device_kind.strip().lower()
    profiles = [HARDWARE.get(name) for name in HARDWARE]
    for profile in profiles:  # exact names first: "tpu v5" is v5p, though "tpu v5 lite" starts with it
        if kind in profile.jax_device_kinds:
            return profile.name
    for profile in profiles:
        if any(pattern.endswith("*") and kind.startswith(pattern[:-1]) for pattern in profile.jax_device_kinds):
            return profile.name
    return None


# Source for rows below unless noted: FACTS.md "Accelerators (per chip)" table, which cites the Cloud
# TPU documentation page of each generation and the jax-ml scaling-book GPU chapter. ICI domain sizes
# are the public pod sizes (v5e/v6e 256, v5p 8960, Ironwood 9216 chips; not in FACTS.md): a slice up
# to that size all-reduces over ICI. GPUs: one 8-GPU NVLink node. MFU: FACTS.md "Published MFU for
# training" (MaxText), scaled down for narrow models (`mfu_reference_width`). The SC constants are the
# Pathways fit above for every accelerator.

_add(HardwareProfile(
    name="tpu-v5e", description="Cloud TPU v5e (8 chips per host, 2D torus, 256-chip pods)",
    jax_device_kinds=("tpu v5 lite", "tpu v5e", "tpu v5litepod"),
    peak_flops=197e12, hbm_bytes=16 * GB, hbm_bandwidth=819 * GB, ici_bandwidth=400 * GB,
    ici_domain_chips=256, dcn_bandwidth_per_chip=2 * 100 * Gbps / 8, chips_per_host=8, train_mfu=0.45,
    decode_weight_bytes_per_value=2,
    sources={"accelerator": "Cloud TPU docs, v5e page (FACTS.md)",
             "dcn_bandwidth_per_chip": "2x100 Gbps NIC per 8-chip host (FACTS.md)",
             "train_mfu": "assumed equal to MaxText v6e Llama-3.1-8B, 45% (FACTS.md); no published v5e figure",
             "decode_weight_bytes_per_value": "bench/results/tpu_parts/placement_round4/placement_run11.json "
                                              "(float32 decode faster than its 4-byte weights could stream)",
             "host": "Pathways 2203.12533 sec. 5.1 fit; native dispatch, decode granularity: assumptions"},
))
_add(HardwareProfile(
    name="tpu-v5p", description="Cloud TPU v5p (4 chips per host, 3D torus)",
    jax_device_kinds=("tpu v5", "tpu v5p"),
    peak_flops=459e12, hbm_bytes=95 * GiB, hbm_bandwidth=2765 * GB, ici_bandwidth=1200 * GB,
    ici_domain_chips=8960, dcn_bandwidth_per_chip=50 * Gbps, chips_per_host=4, train_mfu=0.65,
    sources={"accelerator": "Cloud TPU docs, v5p page (FACTS.md)",
             "train_mfu": "MaxText v5p Llama-3.1-70B, 65% (FACTS.md)",
             "host": "Pathways 2203.12533 sec. 5.1 fit; native dispatch, decode granularity: assumptions"},
))
_add(HardwareProfile(
    name="tpu-v6e", description="Cloud TPU v6e Trillium (4-chip hosts in multi-host slices, 2D torus)",
    jax_device_kinds=("tpu v6 lite", "tpu v6e"),
    peak_flops=918e12, hbm_bytes=32 * GB, hbm_bandwidth=1638 * GB, ici_bandwidth=800 * GB,
    ici_domain_chips=256, dcn_bandwidth_per_chip=100 * Gbps, chips_per_host=4, train_mfu=0.45,
    sources={"accelerator": "Cloud TPU docs, v6e page (FACTS.md); HBM bandwidth also given as 1600/1640",
             "train_mfu": "MaxText v6e Llama-3.1-8B, 45% (FACTS.md)",
             "host": "Pathways 2203.12533 sec. 5.1 fit; native dispatch, decode granularity: assumptions"},
))
_add(HardwareProfile(
    name="tpu-v7x", description="Cloud TPU7x Ironwood (4-chip VMs, 224 vCPU per host)",
    jax_device_kinds=("tpu7x", "tpu v7x", "tpu v7"),
    peak_flops=2307e12, hbm_bytes=192 * GiB, hbm_bandwidth=7380 * GB, ici_bandwidth=1200 * GB,
    ici_domain_chips=9216, dcn_bandwidth_per_chip=100 * Gbps, chips_per_host=4, train_mfu=0.45,
    sources={"accelerator": "Cloud TPU docs, tpu7x page (FACTS.md)",
             "train_mfu": "assumed equal to MaxText v6e Llama-3.1-8B, 45% (FACTS.md); no published v7x figure",
             "host": "Pathways 2203.12533 sec. 5.1 fit; native dispatch, decode granularity: assumptions"},
))
_add(HardwareProfile(
    name="h100", description="NVIDIA H100 SXM (8 GPUs per host on NVLink, 8x400 Gbps per host)",
    jax_device_kinds=("nvidia h100*",),
    peak_flops=989e12, hbm_bytes=80 * GB, hbm_bandwidth=3350 * GB, ici_bandwidth=2 * 450 * GB,
    ici_domain_chips=8, dcn_bandwidth_per_chip=400 * Gbps, chips_per_host=8, train_mfu=0.40,
    sources={"accelerator": "jax-ml scaling-book, GPUs chapter (FACTS.md); NVLink 450 GB/s per direction",
             "train_mfu": "assumption, 40%; no GPU figure in FACTS.md",
             "host": "single controller modelled with the Pathways fit; others: assumptions"},
))
_add(HardwareProfile(
    name="h200", description="NVIDIA H200 (8 GPUs per host on NVLink, 8x400 Gbps per host)",
    jax_device_kinds=("nvidia h200*",),
    peak_flops=989e12, hbm_bytes=141 * GB, hbm_bandwidth=4800 * GB, ici_bandwidth=2 * 450 * GB,
    ici_domain_chips=8, dcn_bandwidth_per_chip=400 * Gbps, chips_per_host=8, train_mfu=0.40,
    sources={"accelerator": "jax-ml scaling-book, GPUs chapter (FACTS.md); NVLink 450 GB/s per direction",
             "train_mfu": "assumption, 40%; no GPU figure in FACTS.md",
             "host": "single controller modelled with the Pathways fit; others: assumptions"},
))

# The local CPU: a "chip" is one JAX CPU device, a "host" is one process (DESIGN.md section 2), and
# every process shares this machine's cores. `locojax probe` measures the real values and writes them
# to a JSON file that `load_local_cpu_profile` reads. The defaults below are one such probe of the
# 2-core development machine (AMD EPYC, CPU family 25, AVX-512, Firecracker microVM; the first probe of
# bench/results/placement_accuracy.json, 2026-11-30): rates of the engine's own kernels at the `tiny`
# preset's width, stated for cores free of other work.
# Other widths take these rates too until a probe measures theirs (`locojax probe` times tiny and small).
_PROBED_2_CORE = "locojax probe on the 2-core development machine, 2026-11-30 (bench/placement_accuracy.py)"
LOCAL_CPU = HardwareProfile(
    name="local-cpu", description="this machine's CPU cores; one process per simulated host",
    jax_device_kinds=("cpu",),
    # The engine's train step at d_model 64 runs its matmuls at the rate of a large float32 matmul here
    # (~215 GFLOP/s for the 2 cores); attention (masked softmax over dense caches, head_dim 16) at ~1/4
    # of that; prefill at ~0.4 of it; each completion slot adds ~10 us of vocabulary work.
    peak_flops=215e9,
    train_mfu=1.0,
    decode_mfu=1.0,
    prefill_mfu=0.39,
    train_attention_efficiency=0.26,
    decode_attention_efficiency=0.059,
    decode_row_overhead_s=10.5e-6,  # per sequence per decode step: sampling over the 384-token vocabulary
    decode_step_overhead_s=0.0,
    train_step_overhead_s=18e-3,
    train_scored_token_overhead_s=10e-6,
    rates_include_memory=True,
    hbm_bytes=4 * GB,  # assumption: what a test run may use of the machine's RAM
    hbm_bandwidth=8.7 * GB,  # probe: a streaming x * 2 over 64 MB
    ici_bandwidth=8.7 * GB,  # devices of one process exchange through shared memory
    ici_domain_chips=1,  # assumption: one device per process; across processes is loopback "DCN"
    dcn_bandwidth_per_chip=1.44 * GB,  # probe: 2-process all-reduce over loopback (gloo), 16 MB
    chips_per_host=1,
    ici_latency_s=10e-6,
    dcn_latency_s=0.12e-3,  # probe: a 1 KB all-reduce across 2 processes, ~0.24 ms (2 hops)
    pcie_bandwidth=8.7 * GB,  # host memory is device memory on CPU: a copy at memory speed
    dispatch_s=4.8e-6,  # probe: a trivial jitted call, dispatched and waited on
    # locojax.modes.sc: one process owns every simulated host's devices and dispatches each host's
    # computation in turn from one Python thread, so a round trip is a local dispatch per host.
    controller_round_trip_s=50e-6,  # assumption
    controller_round_trip_per_host_s=50e-6,  # assumption
    reward_cpu_scale=0.155,  # probe: the `#### N` parse takes ~0.5 us here vs REFERENCE_REGEX_PARSE_S
    ray_call_s=1e-3,  # assumption (not probed): one Ray actor round trip on this machine
    bytes_per_value=4,  # the CPU engine computes in float32 (ModelConfig default)
    train_flops_per_param_token=6.0,  # locojax.train: no remat; old log-probs come from the rollout
    mfu_reference_width=None,  # the probe measures the rates at the sizes the CPU runs
    decode_tokens_per_dispatch=None,  # LoCoJAX's rollout is one lax.while_loop per rollout (DESIGN.md)
    decode_attention="dense",  # locojax.rollout attends all prompt + max_new_tokens cache slots
    shared_machine=True,
    machine_cores=2,  # the probe writes the cores it found
    sources={"rates": _PROBED_2_CORE, "bandwidths": _PROBED_2_CORE, "dcn": _PROBED_2_CORE,
             "dispatch_s": _PROBED_2_CORE, "reward_cpu_scale": _PROBED_2_CORE,
             "other": "assumptions, marked inline"},
)
_add(LOCAL_CPU)


def default_local_cpu_path() -> Path:
    """Where `locojax probe` writes, and callers look for, the measured local profile."""
    return Path.home() / ".locojax" / "local-cpu.json"


def load_local_cpu_profile(path: str | Path) -> HardwareProfile:
    """The `local-cpu` profile with the fields measured by `locojax probe` (a JSON object) applied.

    Only keys that are profile fields are read; the probe also records raw measurements for humans.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    profile_fields = data.get("profile", data)
    if not isinstance(profile_fields, dict):
        raise ValueError(f"{path}: expected a JSON object with a 'profile' mapping")
    known = {field.name for field in dataclasses.fields(HardwareProfile)} - {"name"}
    changes = {key: value for key, value in profile_fields.items() if key in known}
    if "sources" in changes:
        changes["sources"] = dict(changes["sources"])
    return LOCAL_CPU.replace(**changes)


def get_hardware(name: str, local_cpu_profile: str | Path | None = None) -> HardwareProfile:
    """The profile called `name`; `local-cpu` takes measured values from `local_cpu_profile` when given."""
    if name == "local-cpu" and local_cpu_profile is not None:
        return load_local_cpu_profile(local_cpu_profile)
    try:
        return HARDWARE.get(name)
    except KeyError as exc:
        raise ValueError(f"hardware: {exc.args[0]}") from None
