"""Calibration per hardware profile from run directories: what a directory must hold, how an accelerator's
device constants are recovered from small-model runs, what the fit leaves alone, the measured constants a
profile cites, and bench/placement_tpu.py's predict/score round on runs a known profile generated."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from bench import placement_tpu
from locojax import contract as c
from locojax.model.config import PRESETS
from locojax.placement.calibration import (
    Observation,
    calibrate,
    observation_from_payload,
    observation_payload,
    recipe_for,
)
from locojax.placement.findings import PAPER_FINDINGS, shipped_setting
from locojax.placement.hardware import (
    HARDWARE,
    apply_measured_constants,
    read_measured_constants,
)
from tests.placement_runs import SMALL_RUNS, TRUE_V5E, spec_dict, true_times, write_run_dir

BF16 = spec_dict("q-bf16", "qwen3-0.6b", 16, 8, 64, 128, dtype="bfloat16", remat="full", task="gsm8k", steps=5)
F32 = spec_dict("q-f32", "qwen3-0.6b", 4, 4, 96, 128, dtype="float32", remat="full", task="gsm8k", steps=5)


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    return [write_run_dir(root / spec["name"], spec) for spec in SMALL_RUNS]


def test_a_run_directory_becomes_an_observation_or_a_clear_refusal(tmp_path):
    run = write_run_dir(tmp_path / "ok", SMALL_RUNS[0])
    payload = observation_payload(run)
    assert (payload["hardware"], payload["device_kind"], payload["finished"]) == ("tpu-v5e", "TPU v5 lite", True)
    assert payload["measured"]["steps"] == SMALL_RUNS[0]["steps"] - 1  # the compile step is left out
    assert payload["measured"]["step_s"] == pytest.approx(true_times(SMALL_RUNS[0], TRUE_V5E)["step_s"])
    assert payload["digest"] == observation_payload(run)["digest"]  # the same directory, the same digest
    json.dumps(payload)  # what the import route receives

    old = write_run_dir(tmp_path / "old", SMALL_RUNS[0])
    (old / c.ENVIRONMENT_FILE).unlink()
    with pytest.raises(ValueError, match=f"{old / c.ENVIRONMENT_FILE}: not found"):
        observation_payload(old)
    failed = write_run_dir(tmp_path / "failed", SMALL_RUNS[0], finished=False, steps=3)
    with pytest.raises(ValueError, match="2 steady step.*did not finish needs at least 3"):
        observation_payload(failed)
    assert observation_payload(write_run_dir(tmp_path / "failed4", SMALL_RUNS[0], finished=False, steps=4))[
        "finished"] is False
    corrupt = write_run_dir(tmp_path / "corrupt", SMALL_RUNS[0])
    with (corrupt / c.METRICS_FILE).open("a") as handle:
        handle.write("{oops\n")
    with pytest.raises(ValueError, match=rf"{corrupt / c.METRICS_FILE}:\d+: not JSON"):
        observation_payload(corrupt)
    with pytest.raises(ValueError, match="not a directory"):
        observation_payload(tmp_path / "missing")


def test_small_model_runs_recover_an_accelerators_device_constants(small_dirs):
    observations = [observation_from_payload(observation_payload(path)) for path in small_dirs]
    assert recipe_for(HARDWARE.get("tpu-v5e")).phases and not recipe_for(HARDWARE.get("local-cpu")).phases
    result = calibrate(HARDWARE.get("tpu-v5e"), observations)
    assert result.after.step < 0.01 < result.before.step and result.after.phases < 0.01
    assert result.constants["decode_layer_overhead_s"] == pytest.approx(TRUE_V5E.decode_layer_overhead_s, rel=0.05)
    # Out of sample: a 0.6B it never saw, at both dtypes, within a few % (the shipped profile: 20-140% off).
    for spec in (BF16, F32):
        truth, fitted = true_times(spec, TRUE_V5E), true_times(spec, result.profile)
        assert fitted["step_s"] == pytest.approx(truth["step_s"], rel=0.03)
        assert fitted["rollout_s"] == pytest.approx(truth["rollout_s"], rel=0.05)
        assert abs(true_times(spec, HARDWARE.get("tpu-v5e"))["step_s"] / truth["step_s"] - 1) > 0.15


QWEN3_VOCAB = PRESETS["qwen3-0.6b"].vocab_size
# A v5e whose work per vocabulary entry is known: sampling a decoded sequence's next token, and the
# log-softmax and entropy over a scored slot's logits in training.
TRUE_V5E_VOCAB = TRUE_V5E.replace(decode_vocab_overhead_s=0.5e-10, train_vocab_overhead_s=1.5e-10)
# The small preset at Qwen3's vocabulary (bench/tpu.sh's placement-runs: `small@vocab_size=151936`).
REAL_VOCAB_RUNS = [spec_dict("small-v-16x8-128-bf16", "small", 16, 8, 64, 128, dtype="bfloat16", remat="full"),
                   spec_dict("small-v-4x4-96-128", "small", 4, 4, 96, 128, remat="full")]


def with_noise(obs: Observation, rng: np.random.Generator, level: float) -> Observation:
    """`obs` with its rollout and train medians each off by up to `level` (the step moves with them)."""
    m = obs.measured
    rollout, train = (value * (1 + rng.uniform(-level, level)) for value in (m.rollout_s, m.train_s))
    step = m.step_s + (rollout - m.rollout_s) + (train - m.train_s)
    return dataclasses.replace(obs, measured=dataclasses.replace(m, rollout_s=rollout, train_s=train, step_s=step))


def test_vocabulary_costs_are_told_apart_only_by_runs_at_two_vocabulary_sizes(tmp_path):
    """Runs of a byte-level vocabulary alone leave the per-entry costs unfitted (at one size they are
    per-slot costs in disguise), and a 0.6B with 400x the entries is then priced far too low; adding
    small-preset runs at Qwen3's vocabulary recovers both costs, and the 0.6B with them."""
    def observe(spec, vocab_size=None):
        run = write_run_dir(tmp_path / f"{spec['name']}-{vocab_size}", spec, profile=TRUE_V5E_VOCAB,
                            vocab_size=vocab_size)
        return observation_from_payload(observation_payload(run))

    byte_vocab = [observe(spec) for spec in SMALL_RUNS]
    real_vocab = [observe(spec, QWEN3_VOCAB) for spec in REAL_VOCAB_RUNS]
    assert {obs.model.vocab_size for obs in real_vocab} == {QWEN3_VOCAB}  # environment.json carried it
    shipped = HARDWARE.get("tpu-v5e")
    vocab_constants = ("train_vocab_overhead_s", "decode_vocab_overhead_s")

    one = calibrate(shipped, byte_vocab)
    assert not set(vocab_constants) & set(one.constants)
    assert one.profile.train_vocab_overhead_s == one.profile.decode_vocab_overhead_s == 0
    assert one.after.step < 0.05  # in sample the byte-vocabulary runs hardly notice
    truth = true_times(BF16, TRUE_V5E_VOCAB)["step_s"]
    vocab_work = truth - true_times(BF16, TRUE_V5E)["step_s"]
    assert vocab_work > 0.1 * truth
    assert truth - true_times(BF16, one.profile)["step_s"] > 0.5 * vocab_work  # most of it is missed

    two = calibrate(shipped, byte_vocab + real_vocab)
    for name in vocab_constants:
        assert two.constants[name] == pytest.approx(getattr(TRUE_V5E_VOCAB, name), rel=0.03)
    for spec in (BF16, F32):
        fitted, truth = true_times(spec, two.profile), true_times(spec, TRUE_V5E_VOCAB)
        for phase in ("step_s", "rollout_s", "train_s"):
            assert fitted[phase] == pytest.approx(truth[phase], rel=0.03)

    # Not an artefact of exact data: with each run's phases up to 5% off, both are still within 20%.
    rng = np.random.default_rng(0)
    noisy = calibrate(shipped, [with_noise(obs, rng, 0.05) for obs in byte_vocab + real_vocab])
    for name in vocab_constants:
        assert noisy.constants[name] == pytest.approx(getattr(TRUE_V5E_VOCAB, name), rel=0.2)


# A v5e whose training also pays per layer per token per unit of width beyond its matmuls (the
# elementwise passes over each layer's activations), with the vocabulary costs known as above.
TRUE_V5E_DEPTH = TRUE_V5E_VOCAB.replace(train_layer_activation_s=5e-10)


def test_a_per_layer_training_cost_is_told_apart_only_by_runs_of_two_depths(tmp_path):
    """Four-layer runs alone leave training's per-layer activation cost unfitted (at one depth it is a
    per-token cost in disguise, which the fit spreads over the matmul rate and the other per-token
    costs); the same small models at 12 layers recover it, and the 0.6B's phases with it."""
    def observe(spec, vocab_size=None, n_layers=None):
        run = write_run_dir(tmp_path / f"{spec['name']}-{vocab_size}-{n_layers}", spec, profile=TRUE_V5E_DEPTH,
                            vocab_size=vocab_size, n_layers=n_layers)
        return observation_from_payload(observation_payload(run))

    small_preset = [spec for spec in SMALL_RUNS if spec["model"]["preset"] == "small"]  # 4 layers (tiny: 2)
    shallow = [observe(spec) for spec in small_preset] + [observe(spec, QWEN3_VOCAB) for spec in REAL_VOCAB_RUNS]
    deep = [observe(spec, n_layers=12) for spec in small_preset] + [observe(REAL_VOCAB_RUNS[0], QWEN3_VOCAB, 12)]
    assert {obs.model.n_layers for obs in deep} == {12}  # environment.json carried the depth
    shipped = HARDWARE.get("tpu-v5e")
    truth = true_times(BF16, TRUE_V5E_DEPTH)["train_s"]
    layer_work = truth - true_times(BF16, TRUE_V5E_VOCAB)["train_s"]
    assert layer_work > 0.1 * truth

    one = calibrate(shipped, shallow)
    assert "train_layer_activation_s" not in one.constants
    assert one.profile.train_layer_activation_s == 0

    two = calibrate(shipped, shallow + deep)
    assert two.constants["train_layer_activation_s"] == pytest.approx(TRUE_V5E_DEPTH.train_layer_activation_s, rel=0.05)
    for spec in (BF16, F32):
        fitted, truth = true_times(spec, two.profile), true_times(spec, TRUE_V5E_DEPTH)
        for phase in ("step_s", "rollout_s", "train_s"):
            assert fitted[phase] == pytest.approx(truth[phase], rel=0.03)


def test_a_constant_fitted_to_its_bound_stays_a_valid_profile(tmp_path):
    """Runs faster than an MFU of 1 allows (here: a chip 1.5x the datasheet's FLOP/s) push train_mfu to
    its bound; the log-scale fit meets that bound only to rounding (1.0000000000323 once), which the
    profile refuses. The fitted value is the bound itself."""
    fast = TRUE_V5E.replace(peak_flops=1.5 * TRUE_V5E.peak_flops, train_mfu=1.0, mfu_reference_width=None)
    observations = [observation_from_payload(observation_payload(
        write_run_dir(tmp_path / spec["name"], spec, profile=fast))) for spec in SMALL_RUNS]
    result = calibrate(HARDWARE.get("tpu-v5e").replace(train_mfu=1.0, mfu_reference_width=None), observations)
    assert result.constants["train_mfu"] == result.profile.train_mfu == 1.0


def test_a_fit_leaves_the_catalog_and_the_paper_findings_alone(small_dirs):
    before = HARDWARE.get("tpu-v5e")
    observations = [observation_from_payload(observation_payload(path)) for path in small_dirs]
    calibrate(before, observations)
    assert HARDWARE.get("tpu-v5e") is before
    setting = shipped_setting()
    assert all(check(setting)[0] for check in PAPER_FINDINGS.values())


def test_measured_constants_cite_the_json_they_came_from(tmp_path):
    table = read_measured_constants()
    assert set(table) <= set(HARDWARE.names())
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "tpu.json").write_text(json.dumps({"limits": {"matmul_flops": 1.66e14}}))
    good = {"tpu-v5e": {"peak_flops": {"value": 1.66e14, "source": "bench/results/tpu.json#limits.matmul_flops"}}}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(good))
    profile = apply_measured_constants(HARDWARE.get("tpu-v5e"), read_measured_constants(path))
    assert profile.peak_flops == 1.66e14 and profile.sources["peak_flops"] == "bench/results/tpu.json#limits.matmul_flops"
    assert cited_value(tmp_path, profile.sources["peak_flops"]) == profile.peak_flops
    for entry, message in (({"value": 1.0, "source": "FACTS.md"}, "must cite bench/results"),
                           ({"value": "fast", "source": "bench/results/tpu.json#x"}, "must be a number"),
                           ({"value": 1.0}, "expected")):
        path.write_text(json.dumps({"tpu-v5e": {"peak_flops": entry}}))
        with pytest.raises(ValueError, match=message):
            read_measured_constants(path)
    path.write_text(json.dumps({"tpu-v5e": {"colour": {"value": 1, "source": "bench/results/a.json#b"}}}))
    with pytest.raises(ValueError, match="colour: not a hardware profile field"):
        read_measured_constants(path)


def cited_value(root, source: str) -> float:
    file, _, key = source.partition("#")
    value = json.loads((root / file).read_text())
    for part in key.split("."):
        value = value[part]
    return value


def test_every_committed_measured_constant_holds_what_it_cites():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for profile, constants in read_measured_constants().items():
        registered = HARDWARE.get(profile)
        for field, entry in constants.items():
            assert getattr(registered, field) == entry["value"] == pytest.approx(cited_value(root, entry["source"]))
            assert registered.sources[field] == entry["source"]


def test_placement_tpu_predicts_then_scores_without_touching_the_predictions(small_dirs, tmp_path):
    output = tmp_path / "placement_tpu.json"
    placement_tpu.main(["predict", *map(str, small_dirs), "--f32-rows", "4x4", "--output", str(output)])
    data = json.loads(output.read_text())
    names = [p["name"] for p in data["predictions"]]
    assert names == ["qwen3-0.6b-bf16-remat-16x8-64-128", "qwen3-0.6b-f32-kl0-96-128-4x4"]
    assert [run["label"] for run in data["calibration"]["source_runs"]] == [s["name"] for s in SMALL_RUNS]
    assert data["predictions"][0]["predicted"]["step_s"] == pytest.approx(true_times(BF16, TRUE_V5E)["step_s"], rel=0.03)
    committed = {key: data[key] for key in ("calibration", "predictions")}

    measured = [write_run_dir(tmp_path / "m-bf16", BF16), write_run_dir(tmp_path / "m-f32", F32)]
    placement_tpu.main(["score", *map(str, measured), "--output", str(output)])
    scored = json.loads(output.read_text())
    assert {key: scored[key] for key in ("calibration", "predictions")} == committed
    assert [m["name"] for m in scored["measurements"]] == names
    assert scored["max_rel_error"] < 0.03 and scored["within_goal"]
    assert set(scored["measurements"][0]["rel_error"]) == {"step_s", "rollout_s", "reward_s", "train_s"}

    with pytest.raises(SystemExit, match="fitted on"):
        placement_tpu.main(["score", str(small_dirs[0]), "--output", str(output)])
    with pytest.raises(SystemExit, match="trains the model being predicted"):
        placement_tpu.main(["predict", str(measured[0]), "--output", str(tmp_path / "x.json")])
    cpu = write_run_dir(tmp_path / "cpu", SMALL_RUNS[0], profile=HARDWARE.get("local-cpu"), device_kind="cpu",
                        platform="cpu")
    with pytest.raises(SystemExit, match="measured local-cpu .* not the tpu-v5e profile"):
        placement_tpu.main(["predict", str(cpu), "--output", str(tmp_path / "x.json")])
    other = write_run_dir(tmp_path / "m-other", spec_dict("q-other", "qwen3-0.6b", 2, 2, 64, 64, task="gsm8k"))
    with pytest.raises(SystemExit, match="matches 0 predicted configuration"):
        placement_tpu.main(["score", str(other), "--output", str(output)])
    assert math.isfinite(scored["max_rel_error"])

    # A new round of predictions keeps the scored round whole.
    placement_tpu.main(["predict", *map(str, small_dirs), "--output", str(output)])
    second = json.loads(output.read_text())
    assert second["earlier_rounds"] == [scored] and "measurements" not in second


def test_recommend_prices_with_a_calibration_file(small_dirs, tmp_path):
    from typer.testing import CliRunner

    from locojax.cli import app

    output = tmp_path / "placement_tpu.json"
    placement_tpu.main(["predict", *map(str, small_dirs), "--output", str(output)])
    ask = ["recommend", "--model", "qwen3-0.6b", "--hardware", "tpu-v5e", "--chips", "1", "--chips-per-host", "1",
           "--workload", "gsm8k", "--prompts-per-step", "16", "--group-size", "8", "--prompt-len", "64",
           "--gen-len", "128", "--json"]
    runner = CliRunner()
    shipped = json.loads(runner.invoke(app, ask).stdout)["choice"]["step_time_s"]
    fitted = json.loads(runner.invoke(app, [*ask, "--calibration", str(output)]).stdout)["choice"]["step_time_s"]
    assert fitted != pytest.approx(shipped, rel=0.05)
    mismatch = runner.invoke(app, [*ask[:4], "local-cpu", *ask[5:], "--calibration", str(output)])
    assert mismatch.exit_code == c.EXIT_SPEC_ERROR and "fitted for tpu-v5e, not local-cpu" in mismatch.output
