"""Placement: catalog, cost model, the paper's findings, recommender, calibration, CLI and sweep.

The paper-finding tests use the registered profiles exactly as shipped, one set of values for all of
them; but those values include the knobs of `cost_model.FITTED_KNOBS`, chosen together so that the
findings hold. So the finding tests are a calibration regression (they fail when a change moves the
fit), not evidence that the model predicts them: `test_sensitivity_is_the_documented_table` shows how
little some knobs may move, and `test_prediction_the_knobs_were_not_chosen_against` is the one
out-of-sample check.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from locojax.model.config import PRESETS, param_count
from locojax.placement import (
    HARDWARE,
    WORKLOADS,
    InfeasiblePlacement,
    Placement,
    PlacementRequest,
    estimate_step,
    load_local_cpu_profile,
    recommend,
)
from locojax.placement import commands
from locojax.placement.calibration import (
    MeasuredRun,
    Observation,
    StepMeasurement,
    calibrate,
    calibrate_runs,
    summarize,
)
from locojax.placement.cost_model import FITTED_KNOBS, ModelSize, constant_values
from locojax.placement.findings import (
    PAPER_FINDINGS,
    PREDICTIONS,
    scaled_setting,
    sensitivity,
    sensitivity_table,
    shipped_setting,
)
from locojax.placement.sweep import SWEEP_MODELS, run_sweep

V7X = HARDWARE.get("tpu-v7x")
SMALL_MODEL = "qwen3-0.6b"
ROOT = Path(__file__).resolve().parents[2]


def step(mode: str, chips: int, workload: str, fraction: float | None = None, model: str = SMALL_MODEL,
         hardware=V7X):
    placement = Placement(mode, chips, hardware.chips_per_host, fraction)
    return estimate_step(PRESETS[model], hardware, WORKLOADS.get(workload), placement)


# --- catalog -------------------------------------------------------------------------------------


def test_catalog_names_and_sources():
    assert set(HARDWARE.names()) == {"tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7x", "h100", "h200", "local-cpu"}
    assert {"gsm8k", "numina-cot", "math", "arith", "countdown"} <= set(WORKLOADS.names())
    for name in HARDWARE:
        assert HARDWARE.get(name).sources, f"{name} cites no source"
    for name in WORKLOADS:
        assert WORKLOADS.get(name).sources, f"{name} cites no source"


@pytest.mark.parametrize("name,critical", [("tpu-v5e", 240), ("tpu-v5p", 166), ("tpu-v6e", 560),
                                           ("tpu-v7x", 313), ("h100", 295), ("h200", 206)])
def test_critical_batch_matches_scaling_book(name, critical):
    # FACTS.md lists FLOPs/bandwidth per chip; a wrong peak or bandwidth shows up here.
    assert HARDWARE.get(name).critical_batch == pytest.approx(critical, rel=0.03)


def test_local_cpu_profile_reads_probe_output(tmp_path):
    path = tmp_path / "local-cpu.json"
    path.write_text(json.dumps({"profile": {"peak_flops": 1.5e11, "dispatch_s": 2e-5, "not_a_field": 1},
                                "measurements": {"matmul_flops": 1.5e11}}))
    profile = load_local_cpu_profile(path)
    assert profile.name == "local-cpu"
    assert profile.peak_flops == 1.5e11 and profile.dispatch_s == 2e-5
    assert profile.hbm_bandwidth == HARDWARE.get("local-cpu").hbm_bandwidth  # untouched fields keep defaults


# --- cost model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,fraction", [("sc", None), ("co", None), ("da", 0.25), ("da", 0.75)])
@pytest.mark.parametrize("workload", ["gsm8k", "numina-cot"])
def test_breakdown_and_split_add_up_to_the_step(mode, fraction, workload):
    estimate = step(mode, 64, workload, fraction)
    assert sum(estimate.breakdown.values()) == pytest.approx(estimate.step_s, rel=1e-9)
    assert estimate.device_s + estimate.host_s + estimate.network_s == pytest.approx(estimate.step_s, rel=1e-9)
    assert min(estimate.device_s, estimate.host_s, estimate.network_s) >= 0


def test_small_model_decode_is_memory_bound_and_large_model_needs_tensor_parallel():
    assert step("co", 64, "gsm8k").rollout_memory_bound
    assert step("co", 64, "gsm8k").rollout_tensor_parallel == 1
    assert step("co", 64, "gsm8k", model="llama-3.1-405b").rollout_tensor_parallel > 1


def test_decode_reads_weights_at_the_matmul_width_and_the_cache_at_the_stored_one():
    # A float32 run on a chip whose decode takes its loop-invariant weights as bf16: the step reads
    # the weights at 2 bytes a value and the KV cache at 4 (the v5e's float32 calibration runs decode
    # faster than 4-byte weights a step could stream).
    from locojax.placement.cost_model import decode_context, rollout_shape

    model = ModelSize.from_config(PRESETS[SMALL_MODEL])
    workload = WORKLOADS.get("gsm8k")
    float32 = HARDWARE.get("tpu-v5e").replace(bytes_per_value=4, decode_attention="dense")
    assert float32.decode_weight_bytes_per_value == 2
    stored = float32.replace(decode_weight_bytes_per_value=None)

    def decode_s(hardware):
        return rollout_shape(model, hardware, workload, 1, None, 1).decode_step_s

    shape = rollout_shape(model, float32, workload, 1, None, 1)
    assert shape.memory_bound
    cache_bytes = shape.batch_per_replica * model.kv_values_per_token * 4 * decode_context(float32, workload)
    assert decode_s(float32) == pytest.approx((2 * model.params + cache_bytes) / float32.hbm_bandwidth)
    assert decode_s(stored) - decode_s(float32) == pytest.approx(2 * model.params / float32.hbm_bandwidth)
    # bf16 weights are read at their own width either way; a wider matmul width never adds bytes.
    bf16 = float32.replace(bytes_per_value=2)
    assert decode_s(bf16) == pytest.approx(decode_s(bf16.replace(decode_weight_bytes_per_value=None)))
    assert decode_s(bf16) == pytest.approx(decode_s(bf16.replace(decode_weight_bytes_per_value=4)))
    with pytest.raises(ValueError, match="decode_weight_bytes_per_value"):
        float32.replace(decode_weight_bytes_per_value=0)


def test_model_that_does_not_fit_is_infeasible():
    with pytest.raises(InfeasiblePlacement, match="does not fit"):
        step("co", 8, "gsm8k", model="llama-3.1-405b")


def test_single_controller_cost_grows_with_hosts():
    # The Pathways round trip is linear in the host count; CO's dispatch is host-local.
    sc = [step("sc", chips, "gsm8k").host_s for chips in (8, 16, 32, 64)]
    co = [step("co", chips, "gsm8k").host_s for chips in (8, 16, 32, 64)]
    assert sc == sorted(sc) and sc[-1] > 1.3 * sc[0]
    assert max(co) < min(sc)


# --- the paper's findings (FACTS.md, last section): fitted, not predicted ---------------------------


@pytest.fixture(scope="module")
def v7x_sweep():
    return run_sweep(V7X, WORKLOADS.get("gsm8k"))


@pytest.mark.parametrize("finding", list(PAPER_FINDINGS))
def test_calibration_regression_the_fitted_findings_hold(finding):
    """Each finding the knobs were tuned to holds with the shipped values (findings.py has the bands)."""
    holds, figure = PAPER_FINDINGS[finding](shipped_setting())
    assert holds, f"{finding}: {figure}"


def test_the_recommender_picks_what_the_findings_say():
    # The product's path (PlacementRequest -> recommend) agrees with the finding checks' own ranking.
    choice = recommend(PlacementRequest(model=SMALL_MODEL, hardware="tpu-v7x", chips=256,
                                        workload="numina-cot")).choice
    assert (choice.mode, choice.chips, choice.rollout_fraction) == ("da", 256, 0.75)
    assert recommend(PlacementRequest(model=SMALL_MODEL, hardware="tpu-v7x", chips=256,
                                      workload="gsm8k")).choice.mode == "co"


def test_fitted_knobs_are_named_with_their_sources():
    names = [knob.name for knob in FITTED_KNOBS]
    assert len(names) == len(set(names))
    targets = {knob.target for knob in FITTED_KNOBS}
    # The knobs issue 20 found the findings resting on are in the table.
    assert {"hardware:tpu-v7x:decode_tokens_per_dispatch", "hardware:tpu-v7x:mfu_reference_width",
            "workload:numina-cot:prompts_per_step"} <= targets
    for knob in FITTED_KNOBS:
        registry = HARDWARE if knob.kind == "hardware" else WORKLOADS
        assert knob.value == getattr(registry.get(knob.profile), knob.field), knob.name
        # Every one says it was tuned; none pretends to be a measurement.
        assert "tuned to the paper's findings" in knob.source, knob.name


def _readme_sensitivity_table() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    begin, end = "<!-- sensitivity:begin -->", "<!-- sensitivity:end -->"
    return text[text.index(begin) + len(begin):text.index(end)].strip()


def test_sensitivity_is_the_documented_table():
    """Each knob alone, x0.5 to x2 in steps of 2**(1/4): the range of factors around 1 within which each
    finding still holds. The README prints the same table (regenerate it with
    `python -c "from locojax.placement.findings import sensitivity_table; print(sensitivity_table())"`)."""
    table = sensitivity()
    for knob, row in table.items():
        for finding, bounds in row.items():
            assert (bounds.low or 0) <= 1 <= (bounds.high or math.inf), (knob, finding, bounds)
    # Not a tautology: some findings flip within the grid, and the table says where.
    fragile = {(knob, finding) for knob, row in table.items() for finding, bounds in row.items()
               if bounds.low is not None or bounds.high is not None}
    assert ("NuminaMath prompts per step", "DA 75% on Numina") in fragile
    assert ("MFU reference width", "CO 1.3-3.6x SC") in fragile
    assert sensitivity_table(table) == _readme_sensitivity_table()


def test_sensitivity_reports_a_flip_where_one_happens():
    # Doubling the decode chunk (4 -> 8 tokens per host round trip) halves SC's decode round trips:
    # CO's lead over SC at 8 chips must then fall below the paper's 1.3x, and the table must say so.
    knob = next(k for k in FITTED_KNOBS if k.field == "decode_tokens_per_dispatch")
    holds, figure = PAPER_FINDINGS["CO 1.3-3.6x SC"](scaled_setting(knob, 2.0))
    assert not holds, figure
    assert sensitivity([knob])[knob.name]["CO 1.3-3.6x SC"].high < 2.0


def test_prediction_the_knobs_were_not_chosen_against():
    """sglang-jax issue #772 (FACTS.md): a 1.5B model on one v7x host decoded at 44% of native speed
    through the Pathways proxy (60% after a fix). No knob was chosen against it: the fit targeted the
    seed paper's findings only (PAPER_FINDINGS), and this ratio was first computed for issue 20.

    The model says 65% (qwen3-1.7b, GSM8K rollouts, 4 chips): the mechanism (SC's decode is slower) is
    right, the size is 48% off the 44% (closer to the 60% after the fix; #772's proxy round trip,
    ~21 ms, is far above the Pathways fit's ~1.3 ms the model uses). The bound, a 50% error, was set
    after that first computation: it guards the figure against drifting further, it does not claim
    the model predicted #772 well."""
    predict, published, _ = PREDICTIONS["proxy decode speed, 1.5B on one v7x host"]
    predicted = predict()
    assert predicted < 1  # through the proxy decode is slower than native
    assert abs(predicted - published) / published < 0.5, predicted


# --- recommender ---------------------------------------------------------------------------------


def test_recommendation_is_ranked_and_explained():
    result = recommend(PlacementRequest(model=SMALL_MODEL, hardware="tpu-v7x", chips=64, workload="gsm8k"))
    times = [option.step_time_s for option in result.options]
    assert result.choice == result.options[0]
    assert times[1:] == sorted(times[1:]) and times[0] <= times[1] * 1.01
    assert {option.mode for option in result.options} == {"sc", "co", "da"}
    assert any(character.isdigit() for character in result.reason) and "%" in result.reason
    assert result.reason.endswith(".") and "\n" not in result.reason
    assert json.loads(result.model_dump_json())["choice"]["mode"] == result.choice.mode


def test_request_overrides_reach_the_workload():
    request = PlacementRequest(model=SMALL_MODEL, hardware="tpu-v7x", chips=8, workload="gsm8k", gen_len=64,
                               prompts_per_step=4)
    workload = request.workload_profile()
    assert (workload.gen_len, workload.prompts_per_step, workload.gen_len_mean) == (64, 4, 64)
    longer = recommend(request.model_copy(update={"gen_len": 2048}))
    assert recommend(request).choice.step_time_s < longer.choice.step_time_s


@pytest.mark.parametrize("changes,field", [
    ({"model": "qwen9-1t"}, "model"),
    ({"hardware": "tpu-v9"}, "hardware"),
    ({"workload": "chess"}, "workload"),
    ({"chips": 6}, "chips_per_host"),
    ({"chips": 8, "chips_per_host": 3}, "chips_per_host"),
    ({"gen_len": 0}, "gen_len"),
    ({"prompt_len": 0}, "prompt_len"),
    ({"chips": 0}, "chips"),
    ({"colour": "red"}, "colour"),
])
def test_bad_requests_name_the_field(changes, field):
    fields = {"model": SMALL_MODEL, "hardware": "tpu-v7x", "chips": 8, "workload": "gsm8k", **changes}
    with pytest.raises(ValueError, match=field):
        PlacementRequest(**fields)


def test_model_too_large_for_the_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit"):
        recommend(PlacementRequest(model="llama-3.1-405b", hardware="tpu-v5e", chips=8, workload="gsm8k"))


def test_recommend_uses_a_given_profile():
    measured = HARDWARE.get("local-cpu").replace(peak_flops=1e12)
    request = PlacementRequest(model="tiny", hardware="local-cpu", chips=2, workload="arith")
    assert recommend(request, measured).choice.step_time_s < recommend(request).choice.step_time_s
    with pytest.raises(ValueError, match="does not match"):
        recommend(request, V7X)


# --- calibration ---------------------------------------------------------------------------------

# What the fit must recover on the local CPU (one device per process: cross-process traffic is "DCN").
FITTED = ("dispatch_s", "controller_round_trip_s", "controller_round_trip_per_host_s", "reward_cpu_scale",
          "ray_call_s", "dcn_s_per_byte", "dcn_latency_s")


def _synthetic_observations(truth):
    observations = []
    for workload_name, prompts in (("arith", 32), ("arith", 128), ("gsm8k", 8)):
        workload = WORKLOADS.get(workload_name).replace(prompts_per_step=prompts, prompt_len=32, gen_len=16,
                                                        gen_len_mean=12)
        for mode, hosts, fraction in (("co", 2, None), ("co", 4, None), ("sc", 2, None), ("sc", 4, None),
                                      ("da", 2, 0.5), ("da", 4, 0.5)):
            placement = Placement(mode, hosts, 1, fraction)
            estimate = estimate_step(PRESETS["tiny"], truth, workload, placement)
            measured = StepMeasurement(step_s=estimate.step_s, device_s=estimate.device_s, host_s=estimate.host_s,
                                       network_s=estimate.network_s, steps=10)
            observations.append(Observation(ModelSize.from_config(PRESETS["tiny"]), workload, placement, measured))
    return observations


TRUTH = HARDWARE.get("local-cpu").replace(
    dispatch_s=3e-4, controller_round_trip_s=2e-3, controller_round_trip_per_host_s=7e-4, reward_cpu_scale=2.5,
    ray_call_s=4e-3, dcn_bandwidth_per_chip=0.3e9, dcn_latency_s=1.5e-3)


def test_calibration_recovers_known_constants():
    start = HARDWARE.get("local-cpu")
    result = calibrate(start, _synthetic_observations(TRUTH))
    truth = constant_values(TRUTH)
    for name in FITTED:
        assert result.constants[name] == pytest.approx(truth[name], rel=0.05), name
    assert result.after.step < 1e-3 < result.before.step
    assert result.after.host < 1e-3 and result.after.network < 1e-3
    assert result.constants["device_time_scale"] == pytest.approx(1.0, rel=0.01)


def test_calibration_recovers_how_much_slower_the_devices_ran():
    """Runs measured while the machine ran 30% slower than its probe: the fit finds the factor and the
    host and network constants alike (on the shared local machine all three parts slow down)."""
    slower = TRUTH.replace(device_time_scale=1.3)
    result = calibrate(HARDWARE.get("local-cpu"), _synthetic_observations(slower))
    assert result.constants["device_time_scale"] == pytest.approx(1.3, rel=0.02)
    truth = constant_values(TRUTH)
    for name in FITTED:
        assert result.constants[name] == pytest.approx(truth[name], rel=0.1), name
    assert result.after.step < 2e-3 < result.before.step
    without = calibrate(HARDWARE.get("local-cpu"), _synthetic_observations(slower), fit_device_scale=False)
    assert "device_time_scale" not in without.constants and without.after.step > 0.05


def _write_run(directory, spec, estimate, steps=5):
    directory.mkdir()
    (directory / "spec.yaml").write_text(yaml.safe_dump(spec))
    lines = []
    for number in range(steps):
        compile_s = 10.0 if number == 0 else 0.0  # the first step compiles and must be skipped
        for host in (0, 1, "all"):
            lines.append(json.dumps({"step": number, "host": host, "time/step": estimate.step_s + compile_s,
                                     "time/device": estimate.device_s + compile_s, "time/host": estimate.host_s,
                                     "time/network": estimate.network_s, "reward/mean": 0.5}))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_calibration_from_run_directories_and_records(tmp_path):
    runs = []
    for index, (mode, fraction) in enumerate((("co", None), ("sc", None), ("da", 0.5))):
        spec = {"name": f"run{index}", "model": {"preset": "tiny"}, "task": {"name": "arith"},
                "rollout": {"prompts_per_step": 32, "group_size": 8, "max_prompt_tokens": 16, "max_new_tokens": 8},
                "placement": {"mode": mode, "hosts": 2, "devices_per_host": 1, "rollout_fraction": fraction}}
        workload = WORKLOADS.get("arith").replace(prompts_per_step=32, prompt_len=16, gen_len=8, gen_len_mean=4)
        estimate = estimate_step(PRESETS["tiny"], TRUTH, workload, Placement(mode, 2, 1, fraction))
        _write_run(tmp_path / f"run{index}", spec, estimate)
        runs.append(tmp_path / f"run{index}")
    records = [json.loads(line) for line in (tmp_path / "run0" / "metrics.jsonl").read_text().splitlines()]
    direct = MeasuredRun.from_records(yaml.safe_load((tmp_path / "run0" / "spec.yaml").read_text()), records)
    result = calibrate_runs(HARDWARE.get("local-cpu"), [*runs, direct])
    assert result.observations == 4
    assert result.after.step < 0.01 < result.before.step


def test_summarize_skips_compile_and_prefers_aggregated_rows():
    records = [{"step": 0, "host": "all", "time/step": 9.0}, {"step": 1, "host": 0, "time/step": 5.0},
               {"step": 1, "host": "all", "time/step": 1.0}, {"step": 2, "host": "all", "time/step": 3.0}]
    summary = summarize(records)
    assert summary.step_s == 2.0 and summary.steps == 2 and math.isnan(summary.host_s)
    with pytest.raises(ValueError, match="time/step"):
        summarize([{"step": 0, "host": "all"}, {"step": 1, "host": "all"}])


def test_summarize_takes_checkpoint_saves_out_of_step_and_host_time():
    # The last step of every run saves the final checkpoint; the cost model predicts steps without saves.
    records = [{"step": s, "host": "all", "time/step": 1.0, "time/host": 0.1, "time/device": 0.9,
                "time/checkpoint": 0.0} for s in range(1, 4)]
    records.append({"step": 4, "host": "all", "time/step": 1.7, "time/host": 0.8, "time/device": 0.9,
                    "time/checkpoint": 0.7})
    summary = summarize(records, skip_steps=2)  # steps 3 and 4: without the subtraction the median is 1.35
    assert summary.steps == 2
    assert summary.step_s == pytest.approx(1.0) and summary.host_s == pytest.approx(0.1)
    assert summary.device_s == pytest.approx(0.9)


# --- CLI and sweep ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli():
    app = typer.Typer()
    commands.register(app)
    return app


def test_cli_recommend_json_and_table(cli):
    runner = CliRunner()
    args = ["recommend", "--model", SMALL_MODEL, "--hardware", "tpu-v7x", "--chips", "64", "--workload", "gsm8k"]
    result = runner.invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["choice"] == payload["options"][0] and payload["reason"]
    table = runner.invoke(cli, args)
    assert table.exit_code == 0 and "choice:" in table.output


def test_cli_recommend_bad_input_exits_2(cli):
    result = CliRunner().invoke(cli, ["recommend", "--model", "nope", "--hardware", "tpu-v7x", "--chips", "6",
                                      "--workload", "gsm8k"])
    assert result.exit_code == 2
    assert "model" in result.output and "nope" in result.output


def test_cli_sweep_writes_png_and_json(cli, tmp_path):
    result = CliRunner().invoke(cli, ["sweep", "--hardware", "tpu-v7x", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "sweep-tpu-v7x.json").read_text())
    assert [p["model"] for p in data["points"] if p["mode"] == "sc"] == list(SWEEP_MODELS)
    assert (tmp_path / "sweep-tpu-v7x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_gives_big_models_the_chips_they_need(v7x_sweep):
    chips = {p.model: p.chips for p in v7x_sweep.points}
    assert chips[SMALL_MODEL] == 8 and chips["llama-3.1-405b"] > 8
    assert param_count(PRESETS["llama-3.1-405b"]) == next(p.params for p in v7x_sweep.points
                                                          if p.model == "llama-3.1-405b")


# --- memory plan in the recommender (issue 21) ---------------------------------------------------


@pytest.mark.parametrize("model,hardware,chips", [("qwen3-8b", "tpu-v5p", 8), ("qwen3-8b", "tpu-v7x", 64),
                                                  ("qwen3-32b", "tpu-v7x", 64)])
def test_recommended_placements_fit_hbm_for_8b_and_32b(model, hardware, chips):
    from locojax.placement.memory import GiB, USABLE_FRACTION

    result = recommend(PlacementRequest(model=model, hardware=hardware, chips=chips, workload="gsm8k"))
    hbm = HARDWARE.get(hardware).hbm_bytes * USABLE_FRACTION / GiB
    assert all(option.memory_per_chip_gib <= hbm for option in result.options)
    assert result.choice.fsdp * result.choice.tensor > 1  # neither fits one chip unsharded
    assert "memory plan per device" in result.memory
    if model == "qwen3-32b":  # float32 state plus the rollout copy exceed a v7x chip: bfloat16 it is
        assert result.choice.dtype == "bfloat16"


def test_recommender_refuses_32b_on_v5p_naming_the_term_and_what_would_fit():
    from locojax.placement.memory import MemoryPlanError

    with pytest.raises(MemoryPlanError) as refused:
        recommend(PlacementRequest(model="qwen3-32b", hardware="tpu-v5p", chips=64, workload="gsm8k"))
    message = str(refused.value)
    assert "fits HBM" in message and re.search(r"largest term being (gradients|rollout_params)", message)
    assert "more chips per model" in message and "FSDP" in message and "remat" in message


def test_hosts_beyond_a_shared_machines_cores_share_them_for_their_cpu_work():
    """CO on the local CPU: every host scores its own samples at once, so 4 hosts on 2 cores score at
    half a core each and take as long per step as 2 hosts do; with a core per host, twice as many
    hosts halve the time. SC's controller scores alone, so its reward time does not depend on cores."""
    from locojax.placement.cost_model import cpu_sharing
    from locojax.placement.hardware import get_hardware
    from locojax.placement.workloads import get_workload

    model = ModelSize.from_config(PRESETS["tiny"])
    workload = get_workload("arith")

    def reward_s(mode: str, hosts: int, cores: int) -> float:
        hardware = get_hardware("local-cpu").replace(machine_cores=cores, decode_tokens_per_dispatch=None)
        return estimate_step(model, hardware, workload, Placement(mode, hosts, 1)).breakdown["reward"]

    assert cpu_sharing(get_hardware("local-cpu").replace(machine_cores=2), 4) == 2.0
    assert cpu_sharing(get_hardware("local-cpu").replace(machine_cores=2), 1) == 1.0
    assert cpu_sharing(get_hardware("local-cpu").replace(machine_cores=None), 8) == 1.0
    assert reward_s("co", 4, cores=2) == pytest.approx(reward_s("co", 2, cores=2))
    assert reward_s("co", 4, cores=4) == pytest.approx(reward_s("co", 2, cores=4) / 2)
    assert reward_s("sc", 4, cores=2) == pytest.approx(reward_s("sc", 4, cores=4))


def test_a_host_processs_fixed_device_costs_are_cpu_work_shared_beyond_the_cores():
    """The probe measures each dispatch's fixed costs (per decode step and row, per train step and
    scored token) in one process with its own cores. 4 host processes on 2 cores pay them at half a
    core each; the FLOPs were already split among the busy chips, so only the fixed part changes."""
    from locojax.placement.hardware import get_hardware
    from locojax.placement.workloads import get_workload

    model = ModelSize.from_config(PRESETS["tiny"])
    workload = get_workload("arith")
    hardware = get_hardware("local-cpu").replace(decode_tokens_per_dispatch=None)

    def phase_s(phase: str, hosts: int, cores: int | None) -> float:
        placed = Placement("co", hosts, 1)
        return estimate_step(model, hardware.replace(machine_cores=cores), workload, placed).breakdown[phase]

    rates = hardware.rates_for(model.d_model)
    train_fixed = rates.device_time_scale * (workload.samples * workload.gen_len / 4 * rates.train_scored_token_overhead_s
                                             + rates.train_step_overhead_s)
    assert train_fixed > 0
    assert phase_s("train", 4, cores=2) - phase_s("train", 4, cores=4) == pytest.approx(train_fixed)
    assert phase_s("rollout", 4, cores=2) > phase_s("rollout", 4, cores=4) == pytest.approx(phase_s("rollout", 4, None))
    # Within the cores nothing is shared: 2 hosts on 2 cores cost what they cost on 4.
    assert phase_s("train", 2, cores=2) == pytest.approx(phase_s("train", 2, cores=4))


@pytest.mark.parametrize("reward_s_per_sample,longer", [(2e-3, "rollout"), (0.0, "train")])
def test_da_longer_branch_takes_the_cores_the_shorter_one_leaves_idle(reward_s_per_sample, longer):
    """DA on the local CPU, 4 hosts on 2 cores: a rollout host and a train host share each core. Both
    branches are costed with every host busy; once the shorter one is done its hosts idle until the
    weight push, so the longer one's tail runs at a core per host, twice as fast. The span is then
    T_short + (T_long - T_short) / 2. With a core per host (4 cores) nothing is freed."""
    from locojax.placement.hardware import get_hardware
    from locojax.placement.workloads import get_workload

    model = ModelSize.from_config(PRESETS["tiny"])
    workload = get_workload("arith").replace(reward_s_per_sample=reward_s_per_sample)

    def estimate(hosts: int, cores: int):
        hardware = get_hardware("local-cpu").replace(machine_cores=cores, decode_tokens_per_dispatch=None)
        return estimate_step(model, hardware, workload, Placement("da", hosts, 1, 0.5))

    def branches(parts) -> tuple[float, float, float]:
        rollout_branch = parts["rollout"] + parts["reward"]
        train_branch = parts["handoff"] + parts["train"] + parts["allreduce"]
        return rollout_branch, train_branch, parts["weight_sync"] + parts["coordination"]

    shared = estimate(4, cores=2)
    rollout_branch, train_branch, after = branches(shared.breakdown)
    assert (rollout_branch > train_branch) == (longer == "rollout")
    short, long = sorted((rollout_branch, train_branch))
    assert long > 1.1 * short  # a tail long enough for the freed cores to matter
    assert shared.step_s == pytest.approx(short + (long - short) / 2 + after, rel=1e-9)
    assert shared.breakdown["cores_freed"] == pytest.approx(-(long - short) / 2, rel=1e-9)
    assert sum(shared.breakdown.values()) == pytest.approx(shared.step_s, rel=1e-9)
    # The freed time is on the critical path the calibration fits (device, host and network alike).
    assert shared.device_s + shared.host_s + shared.network_s == pytest.approx(shared.step_s, rel=1e-9)

    own_cores = estimate(4, cores=4)
    rollout_branch, train_branch, after = branches(own_cores.breakdown)
    assert own_cores.breakdown["cores_freed"] == 0
    assert own_cores.step_s == pytest.approx(max(rollout_branch, train_branch) + after, rel=1e-9)
    # 2 hosts on 2 cores (the coordination benchmark's 2-host DA): a core each, nothing to free.
    assert estimate(2, cores=2).breakdown["cores_freed"] == 0


def test_coordination_bench_reports_the_hosts_spread_over_the_steady_steps():
    """bench/coordination.py's `host_spread`, which the README quotes for CO's straggler: the slowest and
    the mean host per step, only over the steps it is given, only from per-host rows."""
    from bench.coordination import host_spread

    rows = [{"step": step, "host": host, "time/reward": 1.0 + host + 10 * (step == 0), "time/train": 2.0}
            for step in range(3) for host in range(3)]
    rows += [{"step": step, "host": "all", "time/reward": 99.0} for step in range(3)]  # the aggregate is not a host
    spread = host_spread(rows, {1, 2})  # step 0 (a warm-up) is left out
    assert spread["time/reward"] == {"slowest_s": 3.0, "mean_s": 2.0, "straggler_s": 1.0, "hosts": 3}
    assert spread["time/train"]["straggler_s"] == 0.0
    assert "time/rollout" not in spread  # no host reported it
    assert host_spread([{"step": 1, "host": 0, "time/reward": 1.0}], {1}) == {}  # one host: no spread
