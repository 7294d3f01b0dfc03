"""Placement out of sample on the TPU: calibrate a hardware profile ONLY from small-model runs measured
on the chip, predict Qwen3-0.6B's step and phase times there, commit the predictions, then score them
against 0.6B runs measured afterwards (issue 41).

    python bench/placement_tpu.py predict RUN_DIR... [--hardware tpu-v5e] [--f32-rows 4x4 ...]
    python bench/placement_tpu.py score RUN_DIR...

`predict` reads `locojax train` run directories (spec.yaml, metrics.jsonl, environment.json and, for
finished runs, result.json) with the very code `locojax calibration import` uses
(`locojax.placement.calibration.observation_payload`), offline: no server. Every run must have measured
the profile it calibrates (its environment.json says so) and a model other than the ones it predicts.
It refits the profile (`calibrate`: host constants and the accelerator's device constants, against each
run's step and phases) and writes `bench/results/placement_tpu.json` with the calibration (its constants,
fit error, and every source run: directory, digest, model, measured medians) and `predictions`: per
configuration, the RunSpec fragment priced and the predicted step, phases and split.

`score` reads measured run directories of the predicted configurations (matched by what they ran:
model dimensions, dtype, remat, KL, batch, lengths, placement; `--match NAME=RUN_DIR` forces one),
and adds `measurements` (each run's medians and its relative errors on the step and on each phase) and
`max_rel_error` on the step (target 0.20, goal 0.10). It never rewrites `calibration` or `predictions`:
the file's earlier content is kept as it was and checked unchanged before writing. A later `predict`
starts a new round and keeps the file's earlier rounds, scored or not, under `earlier_rounds`.

A dry run on the CPU: `--hardware local-cpu` with CPU run directories (labelled by their hardware).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "placement_tpu.json"
TARGET_REL_ERROR = 0.20
GOAL_REL_ERROR = 0.10
PHASES = ("rollout_s", "reward_s", "train_s")

# The configurations the issue names; the RunSpec fragment each is priced as (a CO run on one chip).
# `--f32-rows PxG` adds the float32 one at other rows (prompts x group); `--model` prices another preset
# (a dry run on the CPU predicts `small` from `tiny` runs: a 0.6B does not fit the local profile).
PLACEMENT = {"mode": "co", "hosts": 1, "devices_per_host": 1}
TASK = {"name": "gsm8k", "path": "/data/gsm8k.jsonl"}


def bf16_config(preset: str) -> tuple[str, dict[str, Any]]:
    return f"{preset}-bf16-remat-16x8-64-128", {
        "model": {"preset": preset, "dtype": "bfloat16", "remat": "full"}, "task": TASK,
        "rollout": {"prompts_per_step": 16, "group_size": 8, "max_prompt_tokens": 64, "max_new_tokens": 128},
        "algo": {"kl_coef": 0.0}}


def f32_config(preset: str, rows: str) -> tuple[str, dict[str, Any]]:
    try:
        prompts, group = (int(part) for part in rows.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--f32-rows: expected PROMPTSxGROUP such as 4x4, got {rows!r}") from None
    return f"{preset}-f32-kl0-96-128-{prompts}x{group}", {
        "model": {"preset": preset, "dtype": "float32", "remat": "full"}, "task": TASK,
        "rollout": {"prompts_per_step": prompts, "group_size": group, "max_prompt_tokens": 96, "max_new_tokens": 128},
        "algo": {"kl_coef": 0.0}}


def default_configs(preset: str, f32_rows: list[str]) -> dict[str, dict[str, Any]]:
    return dict([bf16_config(preset), *(f32_config(preset, rows) for rows in (f32_rows or ["4x4"]))])


def config_spec(name: str, config: dict[str, Any]):
    from locojax.spec import parse_spec

    return parse_spec({"name": name, "placement": PLACEMENT, **config}, f"configuration {name}")


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def predicted_times(observation, profile) -> dict[str, float]:
    from locojax.placement.calibration import predicted_phases

    estimate = observation.predict(profile)
    return {"step_s": estimate.step_s, **predicted_phases(estimate), "device_s": estimate.device_s,
            "host_s": estimate.host_s, "network_s": estimate.network_s}


def predict(args) -> dict[str, Any]:
    from locojax.model.config import PRESETS
    from locojax.placement.calibration import calibrate, observation_from, observation_from_payload, observation_payload
    from locojax.placement.calibration import StepMeasurement
    from locojax.placement.cost_model import InfeasiblePlacement
    from locojax.placement.hardware import HARDWARE

    if args.hardware not in HARDWARE:
        raise SystemExit(f"--hardware: unknown profile {args.hardware!r}; known: {', '.join(HARDWARE.names())}")
    base = HARDWARE.get(args.hardware)
    if args.model not in PRESETS:
        raise SystemExit(f"--model: unknown preset {args.model!r}; known: {', '.join(PRESETS)}")
    configs = default_configs(args.model, args.f32_rows)
    specs = {name: config_spec(name, config) for name, config in configs.items()}
    predicted_models = {PRESETS[spec.model.preset].d_model: spec.model.preset for spec in specs.values()}
    sources, observations = [], []
    for run_dir in args.runs:
        try:
            payload = observation_payload(run_dir, skip_steps=args.skip_steps)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        if payload["hardware"] != args.hardware:
            raise SystemExit(f"error: {run_dir}: measured {payload['hardware']} ({payload['device_kind']}), "
                             f"not the {args.hardware} profile this calibrates")
        if payload["model"]["d_model"] in predicted_models and payload["model"]["n_layers"] == \
                PRESETS[predicted_models[payload["model"]["d_model"]]].n_layers:
            raise SystemExit(f"error: {run_dir}: trains the model being predicted "
                             f"({predicted_models[payload['model']['d_model']]}); calibrate from other models only")
        observations.append(observation_from_payload(payload, str(run_dir)))
        sources.append({"dir": str(run_dir), "digest": payload["digest"], "label": payload["label"],
                        "hardware": payload["hardware"], "device_kind": payload["device_kind"],
                        "model": payload["model"]["name"], "finished": payload["finished"],
                        "measured": payload["measured"]})
    if not observations:
        raise SystemExit("error: give at least one run directory to calibrate from")
    result = calibrate(base, observations)
    print(f"calibrated {args.hardware} from {len(observations)} run(s): fit error (RMS share of step) "
          f"step {result.before.step:.3f} -> {result.after.step:.3f}, phases {result.before.phases:.3f} -> "
          f"{result.after.phases:.3f}")
    for name, value in result.constants.items():
        print(f"  {name:>28}: {value:.4g}")
    predictions = []
    unknown = StepMeasurement(step_s=1.0, device_s=math.nan, host_s=math.nan, network_s=math.nan, steps=1)
    for name, spec in specs.items():
        observation = observation_from(spec, PRESETS[spec.model.preset].replace(
            dtype=spec.model.dtype, param_dtype=spec.model.dtype), unknown, label=name)
        try:
            times = {key: finite(value) for key, value in predicted_times(observation, result.profile).items()}
            uncalibrated = predicted_times(observation, base)
        except InfeasiblePlacement as exc:
            raise SystemExit(f"error: {name} does not fit {args.hardware}: {exc}") from None
        predictions.append({"name": name, "config": {"placement": PLACEMENT, **configs[name]},
                            "predicted": times, "uncalibrated_step_s": finite(uncalibrated["step_s"])})
        print(f"{name:<40} step {times['step_s']:.3f} s = rollout {times['rollout_s']:.3f} + reward "
              f"{times['reward_s']:.3f} + train {times['train_s']:.3f} (uncalibrated {uncalibrated['step_s']:.3f})")
    return {
        "hardware": args.hardware, "platform": "cpu" if base.shared_machine else "tpu",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(),
        "target_rel_error": TARGET_REL_ERROR, "goal_rel_error": GOAL_REL_ERROR, "skip_steps": args.skip_steps,
        "calibration": {**result.to_json(), "source_runs": sources},
        "predictions": predictions,
    }


def matches(config: dict[str, Any], payload: dict[str, Any]) -> bool:
    """Whether a measured run ran a configuration: the same model dimensions, dtype, remat, KL, batch,
    lengths and placement (the task's file and every other setting may differ)."""
    from locojax.model.config import PRESETS

    spec = payload["spec"]
    wanted = PRESETS[config["model"]["preset"]]
    model = payload["model"]
    same_model = all(model[key] == getattr(wanted, key) for key in ("d_model", "n_layers", "n_heads", "n_kv_heads",
                                                                     "head_dim", "d_ff", "vocab_size"))
    rollout = config["rollout"]
    return (same_model and spec["model"]["dtype"] == config["model"]["dtype"]
            and spec["model"]["remat"] == config["model"]["remat"]
            and float(spec["algo"]["kl_coef"]) == float(config["algo"]["kl_coef"])
            and all(spec["rollout"][key] == value for key, value in rollout.items())
            and all(spec["placement"][key] == value for key, value in PLACEMENT.items()))


def score(args) -> dict[str, Any]:
    from locojax.placement.calibration import observation_payload

    if not args.output.is_file():
        raise SystemExit(f"error: {args.output}: not found; run `predict` first")
    data = json.loads(args.output.read_text(encoding="utf-8"))
    committed = json.dumps({key: data.get(key) for key in ("calibration", "predictions", "earlier_rounds")}, sort_keys=True)
    by_name = {prediction["name"]: prediction for prediction in data["predictions"]}
    sources = {run["digest"] for run in data["calibration"]["source_runs"]}
    forced = {}
    for item in args.match or []:
        name, _, run_dir = item.partition("=")
        if name not in by_name or not run_dir:
            raise SystemExit(f"--match: expected NAME=RUN_DIR with NAME one of {', '.join(by_name)}, got {item!r}")
        forced[str(Path(run_dir))] = name
    measurements = []
    for run_dir in args.runs:
        try:
            payload = observation_payload(run_dir, skip_steps=data.get("skip_steps", 1))
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        if payload["digest"] in sources:
            raise SystemExit(f"error: {run_dir}: is one of the runs the calibration was fitted on")
        if payload["hardware"] != data["hardware"]:
            raise SystemExit(f"error: {run_dir}: measured {payload['hardware']}, the predictions are for "
                             f"{data['hardware']}")
        name = forced.get(str(Path(run_dir)))
        if name is None:
            found = [prediction["name"] for prediction in data["predictions"] if matches(prediction["config"], payload)]
            if len(found) != 1:
                raise SystemExit(f"error: {run_dir}: matches {len(found)} predicted configuration(s) "
                                 f"({', '.join(found) or 'none'}); name one with --match NAME={run_dir}")
            name = found[0]
        predicted, measured = by_name[name]["predicted"], payload["measured"]
        errors = {key: (predicted[key] - measured[key]) / measured[key]
                  for key in ("step_s", *PHASES) if measured.get(key) and predicted.get(key) is not None}
        measurements.append({"name": name, "dir": str(run_dir), "digest": payload["digest"],
                             "device_kind": payload["device_kind"], "finished": payload["finished"],
                             "measured": measured, "rel_error": errors})
        print(f"{name:<40} measured step {measured['step_s']:.3f} s, predicted {predicted['step_s']:.3f} s: "
              + ", ".join(f"{key} {value:+.1%}" for key, value in errors.items()))
    if not measurements:
        raise SystemExit("error: give at least one measured run directory")
    max_rel_error = max(abs(m["rel_error"]["step_s"]) for m in measurements)
    data.update(measurements=measurements, max_rel_error=max_rel_error,
                within_target=max_rel_error <= TARGET_REL_ERROR, within_goal=max_rel_error <= GOAL_REL_ERROR,
                scored_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), scored_commit=git_commit())
    unchanged = json.dumps({key: data.get(key) for key in ("calibration", "predictions", "earlier_rounds")}, sort_keys=True)
    assert unchanged == committed, "scoring must not change the committed calibration or predictions"
    print(f"max_rel_error={max_rel_error:.3f} (target {TARGET_REL_ERROR}, goal {GOAL_REL_ERROR})")
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    predicting = commands.add_parser("predict", help="calibrate from small-model runs, predict the 0.6B configurations")
    predicting.add_argument("runs", nargs="+", type=Path, help="`locojax train` run directories measured on the chip")
    predicting.add_argument("--hardware", default="tpu-v5e", help="the profile to calibrate (local-cpu: a dry run)")
    predicting.add_argument("--model", default="qwen3-0.6b", help="the preset the configurations train")
    predicting.add_argument("--f32-rows", action="append", default=[], metavar="PxG",
                            help="rows of the float32 configuration (prompts x group; repeat; default 4x4)")
    predicting.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out of each run's medians")
    scoring = commands.add_parser("score", help="add measured runs of the predicted configurations")
    scoring.add_argument("runs", nargs="+", type=Path, help="run directories of the predicted configurations")
    scoring.add_argument("--match", action="append", metavar="NAME=RUN_DIR", help="pair a run with a prediction")
    for sub in (predicting, scoring):
        sub.add_argument("--output", type=Path, default=RESULTS, help=f"the results file (default {RESULTS})")
    args = parser.parse_args(argv)
    data = predict(args) if args.command == "predict" else score(args)
    if args.command == "predict" and args.output.exists():
        # A new round of predictions keeps the earlier rounds, scored or not, as they were.
        earlier = json.loads(args.output.read_text(encoding="utf-8"))
        rounds = earlier.pop("earlier_rounds", [])
        data["earlier_rounds"] = [*rounds, earlier]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
