"""Run directories as `locojax train` writes them (spec.yaml, metrics.jsonl, environment.json, result.json),
with step times a known hardware profile predicts: what the calibration, its import route and
bench/placement_tpu.py read, made without running JAX. A fit must recover what generated them."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from locojax import contract as c
from locojax.model.config import PRESETS, ModelConfig
from locojax.placement.calibration import StepMeasurement, observation_from, predicted_phases
from locojax.placement.hardware import HARDWARE, HardwareProfile
from locojax.spec import dump_spec, parse_spec

# A v5e "as measured": the catalog's datasheet figures with device costs it does not know.
TRUE_V5E = HARDWARE.get("tpu-v5e").replace(
    train_mfu=0.55, mfu_reference_width=1400, train_step_overhead_s=2e-3, decode_layer_overhead_s=60e-6,
    hbm_bandwidth=0.8 * HARDWARE.get("tpu-v5e").hbm_bandwidth, dispatch_s=2e-3)
COMPILE_FACTOR = 40.0  # the first step compiles


def spec_dict(name: str, preset: str, prompts: int, group: int, prompt_len: int, new_tokens: int, *,
              dtype: str = "float32", remat: str = "none", kl: float = 0.0, task: str = "arith",
              steps: int = 6) -> dict[str, Any]:
    return {"name": name, "model": {"preset": preset, "dtype": dtype, "remat": remat},
            "task": {"name": task, **({"path": "/data/gsm8k.jsonl"} if task == "gsm8k" else {})},
            "rollout": {"prompts_per_step": prompts, "group_size": group, "max_prompt_tokens": prompt_len,
                        "max_new_tokens": new_tokens},
            "algo": {"kl_coef": kl}, "steps": steps, "placement": {"mode": "co", "hosts": 1, "devices_per_host": 1}}


def run_model(spec: dict[str, Any], vocab_size: int | None = None, n_layers: int | None = None) -> ModelConfig:
    """The model a run of `spec` trains: its preset in its dtype, at `vocab_size` and `n_layers` where
    given (as bench/scale.py's `--model-preset small@vocab_size=...,n_layers=...` builds it;
    environment.json records it)."""
    parsed = parse_spec(spec)
    model = PRESETS[parsed.model.preset].replace(dtype=parsed.model.dtype, param_dtype=parsed.model.dtype)
    changed = {name: value for name, value in (("vocab_size", vocab_size), ("n_layers", n_layers)) if value}
    return model.replace(**changed) if changed else model


def true_times(spec: dict[str, Any], profile: HardwareProfile, vocab_size: int | None = None,
               n_layers: int | None = None) -> dict[str, float]:
    parsed = parse_spec(spec)
    model = run_model(spec, vocab_size, n_layers)
    unmeasured = StepMeasurement(step_s=1.0, device_s=math.nan, host_s=math.nan, network_s=math.nan, steps=1)
    estimate = observation_from(parsed, model, unmeasured).predict(profile)
    return {"step_s": estimate.step_s, **predicted_phases(estimate), "device_s": estimate.device_s,
            "host_s": estimate.host_s, "network_s": estimate.network_s}


def write_run_dir(directory: Path, spec: dict[str, Any], *, profile: HardwareProfile = TRUE_V5E,
                  device_kind: str = "TPU v5 lite", platform: str = "tpu", finished: bool = True,
                  steps: int | None = None, vocab_size: int | None = None, n_layers: int | None = None) -> Path:
    """A run directory of `spec` whose steady steps take what `profile` predicts (the first one compiles);
    with `vocab_size` or `n_layers`, of its preset at that vocabulary size or depth."""
    directory.mkdir(parents=True, exist_ok=True)
    parsed = parse_spec(spec)
    (directory / c.SPEC_FILE).write_text(dump_spec(parsed), encoding="utf-8")
    times = true_times(spec, profile, vocab_size, n_layers)
    steps = parsed.steps if steps is None else steps
    sink = c.JsonlSink(directory / c.METRICS_FILE, append=False)
    for step in range(steps):
        scale = COMPILE_FACTOR if step == 0 else 1.0
        record = {c.TIME_STEP: times["step_s"] * scale, c.TIME_ROLLOUT: times["rollout_s"] * scale,
                  c.TIME_REWARD: times["reward_s"], c.TIME_TRAIN: times["train_s"] * scale,
                  c.TIME_DEVICE: times["device_s"] * scale, c.TIME_HOST: times["host_s"],
                  c.TIME_NETWORK: times["network_s"], c.TIME_CHECKPOINT: 0.0}
        sink.write(step, 0, record)
        sink.write(step, c.ALL_HOSTS, record)
    sink.close()
    model = run_model(spec, vocab_size, n_layers)
    c.write_environment(directory, c.EngineEnvironment(
        platform=platform, device_kind=device_kind, hardware=profile.name, devices=1, local_devices=1,
        processes=1, device_memory_bytes=16 * 2**30 if platform == "tpu" else None,
        model=dataclasses.asdict(model)))
    if finished:
        c.write_result(directory, c.RunResult(c.EngineStatus.SUCCEEDED.value, steps, None, {}))
    return directory


# Small-model runs of the kinds a TPU session measures (batches, lengths, widths that tell the device
# costs apart), and the 0.6B configurations they must predict.
SMALL_RUNS = [
    spec_dict("small-8x8-64", "small", 8, 8, 64, 64),
    spec_dict("small-32x8-128", "small", 32, 8, 64, 128),
    spec_dict("small-64x8-128-bf16", "small", 64, 8, 64, 128, dtype="bfloat16", remat="full"),
    spec_dict("tiny-16x8-64", "tiny", 16, 8, 32, 64),
    spec_dict("tiny-64x8-256", "tiny", 64, 8, 64, 256),
]


def json_payload(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))
