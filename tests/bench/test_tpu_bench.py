"""The TPU benchmark harness's own logic, on this CPU: the profile-trace reader on a real jax.profiler
trace, and the merge of a refresh's parts (bench/profile_trace.py, bench/tpu_merge.py)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest


def test_trace_reader_finds_the_ops_the_host_phases_and_the_idle_time_it_waited_on_the_host(tmp_path):
    """A real trace of 3 of 6 steps, after a lead-in one (the sink the benchmarks use), each a jitted
    matmul in a rollout phase then 30 ms of host sleep with nothing dispatched: the idle time covers at
    least the sleeps, the busy time is the op time, and the matmul's module tops the rollout phase's ops."""
    import jax
    import jax.numpy as jnp

    from bench.profile_trace import ProfiledSteps, annotated_phases, summarise_trace
    from locojax import metrics as m

    @jax.jit
    def bench_matmul_step(x):
        return jnp.tanh(x @ x) @ x

    x = jnp.ones((384, 384), jnp.float32) / 384
    timer, sleep_s, sink = m.PhaseTimer(), 0.03, ProfiledSteps(str(tmp_path), first_step=2, steps=3)
    with annotated_phases():
        for step in range(6):
            with timer.step():
                with timer.phase(m.TIME_ROLLOUT):
                    bench_matmul_step(x).block_until_ready()
                time.sleep(sleep_s)
            sink.write(step, m.ALL_HOSTS, {})
    sink.close()
    assert sink.traced and not sink.tracing

    summary = summarise_trace(str(tmp_path))
    assert summary["steps"] == 3 and summary["source"]["kind"].startswith("host plane")
    assert summary["op_events"] > 0 and 0 < summary["busy_s"] < summary["window_s"]
    idle_s = summary["device_idle_fraction"] * summary["window_s"]
    assert idle_s >= 0.9 * 3 * sleep_s
    assert summary["device_idle_fraction"] == pytest.approx(1 - summary["busy_s"] / summary["window_s"])
    rollout = summary["top_ops_by_phase"][m.TIME_ROLLOUT]
    assert rollout["top_ops"][0]["module"] == "jit_bench_matmul_step"
    assert sum(op["share"] for op in rollout["top_ops"]) == pytest.approx(1.0)
    assert sum(kind["share"] for kind in rollout["top_kinds"]) == pytest.approx(1.0)
    assert summary["phase_wall_s_per_step"][m.TIME_ROLLOUT] > 0


def test_program_breakdown_splits_idle_time_between_and_inside_programs():
    """A device line of two programs in a 100 ns step window: `rollout` runs 10-50 with ops 10-20 and
    30-50 (10 ns idle inside it), `train` runs 70-90 with one op over it; 20 + 30 ns nothing runs."""
    from types import SimpleNamespace as N

    from bench.profile_trace import MODULES_LINE, OpEvent, program_breakdown

    def event(name, start, duration):
        return N(name=name, start_ns=start, duration_ns=duration, stats=[])

    modules = N(name=MODULES_LINE, events=[event("rollout(1)", 10, 40), event("train(2)", 70, 20)])
    profile = N(planes=[N(name="/device:TPU:0", lines=[modules])])
    ops = [OpEvent(10, 20, 10, "a", "rollout", "", ""), OpEvent(30, 50, 20, "b", "rollout", "", ""),
           OpEvent(70, 90, 20, "c", "train", "", "")]
    phases = [(0, 55, "time/rollout"), (60, 95, "time/train")]
    breakdown = program_breakdown(profile, ops, phases, (0, 100), [0, 100], steps=1)
    assert breakdown["idle_between_programs_s_per_step"] == pytest.approx(40e-9)
    assert breakdown["idle_inside_programs_s_per_step"] == pytest.approx(10e-9)
    assert breakdown["per_program"]["rollout"] == {"runs_per_step": 1.0, "wall_ms_per_step": 40e-6,
                                                   "op_busy_ms_per_step": 30e-6}
    assert [entry["what"] for entry in breakdown["last_step_timeline_ms"]] == [
        "phase time/rollout", "device rollout", "phase time/train", "device train"]
    no_device = N(planes=[N(name="/host:CPU", lines=[modules])])
    assert program_breakdown(no_device, ops, phases, (0, 100), [0, 100], steps=1) is None


def test_host_profile_names_the_call_a_steady_step_spends_its_host_time_in():
    """cProfile over steps 2-3 of 5, each a short sum then a distinctly named host function that
    sleeps 20 ms: that function tops the cumulative ranking at one call and ~20 ms a step, and the
    steps outside the window are not counted."""
    from bench.profile_trace import HostProfiledSteps
    from locojax import metrics as m

    def host_work_that_keeps_the_device_waiting():
        time.sleep(0.02)

    sink = HostProfiledSteps(first_step=2, steps=2)
    for step in range(5):
        sum(range(1000))
        host_work_that_keeps_the_device_waiting()
        sink.write(step, m.ALL_HOSTS, {})
        sink.write(step, 0, {})  # a host's own record is not a step boundary
    sink.close()

    summary = sink.summary()
    assert summary["steps"] == 2 and 0.02 <= summary["wall_s_per_step"] < 0.2
    top = summary["by_cumulative_time"][0]
    assert "host_work_that_keeps_the_device_waiting" in top["function"]
    assert top["calls_per_step"] == 1.0
    assert 0.018 <= top["cumulative_s_per_step"] <= summary["wall_s_per_step"]
    assert any("sleep" in f["function"] for f in summary["by_self_time"][:3])


def test_busy_time_is_the_union_of_op_intervals_and_self_time_excludes_nested_ops():
    from bench.profile_trace import _self_times, union_ns

    assert union_ns([(0, 10), (5, 15), (20, 25)]) == 20
    assert union_ns([(0, 10), (2, 3)]) == 10 and union_ns([]) == 0
    events = [SimpleNamespace(start_ns=0, duration_ns=100), SimpleNamespace(start_ns=10, duration_ns=30),
              SimpleNamespace(start_ns=50, duration_ns=20), SimpleNamespace(start_ns=200, duration_ns=5)]
    assert _self_times(events) == [50.0, 30.0, 20.0, 5.0]


def _grpo_part(stage, commit, size, runs, rows_search=None, digest="d0"):
    return {"benchmark": "grpo_step", "size": size, "stage": stage, "commit": commit, "dirty": False,
            "source_digest": digest, "date_utc": f"2026-01-0{len(stage) % 9}T00:00:00Z", "platform": "tpu",
            "device_kind": "TPU v5 lite", "rows": runs[0]["rows"], "workload": {"size": size},
            "rows_search": rows_search, "skipped": [], "per_run": runs}


def _run(side, rows, periods, round_index=0, peak=None):
    phases = ({name: [0.01] * len(periods) for name in ("time/rollout", "time/reward", "time/advantage",
                                                          "time/train", "time/device", "time/host", "time/network",
                                                          "time/checkpoint", "time/step")}
              if side == "locojax" else {"rollout": [0.01] * len(periods), "train": [0.02] * len(periods)})
    return {"side": side, "round": round_index, "rows": rows, "ok": True, "periods_s": periods,
            "cpu_s": [0.1] * len(periods), "phases_s": phases, "first_step_s": 40.0, "peak_rss_mib": 100.0,
            "peak_device_gib": peak, "planned_gib": 4.0,
            "identical_work": {"ok": True, "trained_tokens_per_step": 1000.0}}


def test_merge_pools_size_c_rounds_at_the_rows_both_fit_and_marks_mixed_commits(tmp_path):
    """Size c from a rows-search part and a rounds part of another commit: only the runs at the rows
    both sides fit count, each side's step is the median of its pooled periods, and the merged JSON
    lists both parts and says they measured different commits."""
    from bench.tpu_merge import load_parts, merge_grpo

    search = {"rows_both_fit": 16, "locojax": {"largest_rows": 64, "attempts": []},
              "peer": {"largest_rows": 16, "attempts": []}}
    parts = {
        "part_size-c-rows.json": _grpo_part("size-c-rows", "aaa", "c", [
            {**_run("locojax", 64, [9.0, 9.0]), "round": None}, _run("tunix", 16, [0.8, 0.9])], search),
        "part_size-c1.json": _grpo_part("size-c1", "bbb", "c", [
            _run("locojax", 16, [0.6, 0.7], peak=3.0), _run("tunix", 16, [1.0, 1.1])]),
        "part_size-a.json": _grpo_part("size-a", "aaa", "a", [_run("locojax", 64, [0.05]),
                                                              _run("tunix", 64, [0.06])]),
    }
    for name, part in parts.items():
        (tmp_path / name).write_text(json.dumps(part))
    merged = merge_grpo(load_parts(tmp_path))

    assert merged["mixed_commits"] is True and {p["commit"] for p in merged["parts"]} == {"aaa", "bbb"}
    c = merged["sizes"]["c"]
    assert c["rows"] == 16 and c["largest_rows"] == {"locojax": 64, "peer": 16}
    assert c["locojax_step_s"] == pytest.approx(0.65) and c["peer_step_s"] == pytest.approx(0.95)
    assert c["ratio_vs_peer"] == pytest.approx(0.95 / 0.65)
    assert c["rounds_per_side"] == {"locojax": 1, "peer": 2} and "rounds_note" in c
    assert c["mixed_commits"] is True and c["peak_device_vs_plan"] == pytest.approx(0.75)
    assert merged["sizes"]["a"]["mixed_commits"] is False
    assert merged["sizes"]["a"]["ratio_vs_peer"] == pytest.approx(0.06 / 0.05)


def test_merged_peak_against_plan_comes_from_the_newest_part_when_the_plan_changed_between_commits(tmp_path):
    """Size c's rounds from two commits whose memory plans differ for the same run (one engine change
    apart): each run is set against its own plan, every ratio is listed, and the headline is the newest
    part's, not the largest peak over the oldest part's plan."""
    from bench.tpu_merge import load_parts, merge_grpo

    older = {**_grpo_part("size-c1", "old", "c", [_run("locojax", 16, [0.6], peak=3.0), _run("tunix", 16, [1.0])]),
             "date_utc": "2026-01-01T00:00:00Z"}
    newer = {**_grpo_part("size-c2", "new", "c", [_run("tunix", 16, [1.1], round_index=1),
                                                   {**_run("locojax", 16, [0.7], round_index=1, peak=3.0),
                                                    "planned_gib": 3.1}]),
             "date_utc": "2026-01-02T00:00:00Z"}
    (tmp_path / "part_size-c1.json").write_text(json.dumps(older))
    (tmp_path / "part_size-c2.json").write_text(json.dumps(newer))
    c = merge_grpo(load_parts(tmp_path))["sizes"]["c"]

    assert c["peak_device_vs_plan"] == pytest.approx(3.0 / 3.1) and c["planned_gib"] == 3.1
    assert sorted(c["peak_device_vs_plan_per_run"]) == pytest.approx([0.75, 3.0 / 3.1])
    assert {run["part_commit"] for run in c["per_run"]} == {"old", "new"}


def test_lora_merge_reports_our_largest_rows_and_compares_with_the_peer_at_the_rows_both_fit(tmp_path):
    """lora_tpu.json: the model's figures are ours at the largest rows we fit (64), with that run's peak
    vs plan; ratio_vs_peer is at the rows both fit (16), and the throughput ratio sets each side's largest
    rows against the other's."""
    from bench.tpu_merge import load_parts, merge_lora

    search = {"rows_both_fit": 16, "locojax": {"largest_rows": 64, "attempts": []},
              "peer": {"largest_rows": 16, "attempts": []}}
    part = _grpo_part("lora-1.7b", "eee", "lora", [
        {**_run("locojax", 64, [5.0, 5.2], peak=13.0), "round": None, "planned_gib": 12.5,
         "train_tokens": [22000.0, 22000.0], "steps_completed": 5},
        _run("tunix", 16, [2.4, 2.4]),
        {**_run("locojax", 16, [2.2, 2.2], peak=9.0), "planned_gib": 7.5, "train_tokens": [5500.0, 5500.0]}],
        search)
    part["workload"] = {"size": "lora", "preset": "small", "new_tokens": 256,
                        "lora": {"rank": 16, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}}
    (tmp_path / "part_lora-1.7b.json").write_text(json.dumps(part))
    model = merge_lora(load_parts(tmp_path))["models"]["small"]

    assert model["rows"] == 64 and model["step_s"] == pytest.approx(5.1) and model["steps_completed"] == 5
    assert model["peak_device_vs_plan"] == pytest.approx(13.0 / 12.5)
    assert model["rollout_tokens_per_s"] == pytest.approx(64 * 256 / 0.01)
    assert model["ratio_rows"] == 16 and model["ratio_vs_peer"] == pytest.approx(2.4 / 2.2)
    assert model["ours_at_ratio_rows"]["peak_device_vs_plan"] == pytest.approx(9.0 / 7.5)
    assert model["throughput_ratio_at_largest_rows"] == pytest.approx((64 / 5.1) / (16 / 2.4))
    assert model["meets_target"] is False


def test_lora_merge_compares_each_rollout_setting_of_ours_with_the_peers_runs_and_names_the_best(tmp_path):
    """A part of ours alone (--peer none) with model.lora.rollout "merged" at the rows both fit: its runs
    are pooled apart from the default setting's, each setting set against the peer's runs of the other
    part; the headline ratio is the better setting's, named, and the largest-rows figures stay the
    default setting's."""
    from bench.tpu_merge import load_parts, merge_lora

    search = {"rows_both_fit": 16, "locojax": {"largest_rows": 64, "attempts": []},
              "peer": {"largest_rows": 16, "attempts": []}}
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    adapters = _grpo_part("lora-1.7b", "eee", "lora", [
        {**_run("locojax", 64, [5.0, 5.2]), "round": None, "steps_completed": 5},
        _run("tunix", 16, [2.4, 2.4]), _run("locojax", 16, [2.2, 2.2])], search)
    adapters["workload"] = {"size": "lora", "preset": "small", "new_tokens": 256,
                            "lora": {"rank": 16, "targets": targets}}  # before the setting existed: adapters
    merged = _grpo_part("lora-1.7b-merged", "fff", "lora", [
        _run("locojax", 16, [1.6, 1.6]), _run("locojax", 16, [1.7, 1.7], round_index=1)])
    merged["workload"] = {"size": "lora", "preset": "small", "new_tokens": 256,
                          "lora": {"rank": 16, "targets": targets, "rollout": "merged"}}
    (tmp_path / "part_lora-1.7b.json").write_text(json.dumps(adapters))
    (tmp_path / "part_lora-1.7b-merged.json").write_text(json.dumps(merged))
    model = merge_lora(load_parts(tmp_path))["models"]["small"]

    assert model["rows"] == 64 and model["step_s"] == pytest.approx(5.1)
    assert model["ratio_lora_rollout"] == "merged" and model["ratio_rows"] == 16
    assert model["ratio_vs_peer"] == pytest.approx(2.4 / 1.65) and model["ours_at_ratio_rows"]["step_s"] == 1.65
    variants = model["lora_rollout_variants"]
    assert variants["adapters"]["ratio_vs_peer"] == pytest.approx(2.4 / 2.2)
    assert variants["merged"]["rounds_per_side"] == {"locojax": 2, "peer": 1}
    assert variants["merged"]["commits"] == ["eee", "fff"]  # the peer's runs came from the other part


def test_lora_merge_keeps_the_peers_search_when_a_later_part_of_ours_alone_fits_more_rows(tmp_path):
    """The 4B: a rows search where the peer failed at 8 rows, then our side alone (--peer none) in
    micro-batches fitting 64 rows where the first search fit 48: the model's figures are at 64 rows, the
    search keeps the peer's failed attempt, and our largest rows are 64."""
    from bench.tpu_merge import load_parts, merge_lora

    first = {"rows_both_fit": None, "locojax": {"largest_rows": 48, "attempts": []},
             "peer": {"largest_rows": None, "attempts": [{"rows": 8, "status": "failed", "error": "OOM"}]}}
    alone = {"rows_both_fit": None, "locojax": {"largest_rows": 64, "attempts": []},
             "peer": {"largest_rows": None, "attempts": []}}
    workload = {"size": "lora", "preset": "big", "new_tokens": 256, "lora": {"rank": 16, "targets": ["q"]}}
    older = {**_grpo_part("lora-4b", "aaa", "lora", [{**_run("locojax", 48, [8.1, 8.2]), "round": None},
                                                      {**_run("tunix", 8, []), "ok": False, "round": None}], first),
             "workload": workload, "date_utc": "2026-01-01T00:00:00Z"}
    newer = {**_grpo_part("lora-4b", "bbb", "lora", [{**_run("locojax", 64, [9.3, 9.3]), "round": None}], alone),
             "workload": {**workload, "micro_batch_size": 16}, "date_utc": "2026-01-02T00:00:00Z"}
    (tmp_path / "part_lora-4b.json").write_text(json.dumps(older))
    (tmp_path / "part_lora-4b-bbb.json").write_text(json.dumps(newer))
    model = merge_lora(load_parts(tmp_path))["models"]["big"]

    assert model["rows"] == 64 and model["step_s"] == pytest.approx(9.3)
    search = model["detail"]["rows_search"]
    assert search["peer"]["attempts"][0]["error"] == "OOM" and search["locojax"]["largest_rows"] == 64
    assert model["detail"]["largest_rows"] == {"locojax": 64, "peer": None}


def test_merge_completes_the_scale_part_with_the_limits_and_tests_parts(tmp_path):
    from bench.tpu_merge import load_parts, merge_scale

    batch = {"prompts": 16, "group_size": 8, "max_prompt_tokens": 64, "max_new_tokens": 128, "dtype": "bfloat16",
             "remat": "full"}
    header = {"commit": "ccc", "dirty": False, "source_digest": "d1", "platform": "tpu", "device_kind": "TPU v5 lite"}
    (tmp_path / "part_scale.json").write_text(json.dumps({
        "benchmark": "scale", "stage": "scale", **header, "date_utc": "2026-01-02T00:00:00Z", "batch": batch,
        "rounds": [{}], "train_model_flops_per_step": 2e14, "train_s": 2.0, "decode_vs_roofline": None}))
    (tmp_path / "part_limits.json").write_text(json.dumps({
        "benchmark": "scale_limits", "stage": "limits", **header, "date_utc": "2026-01-03T00:00:00Z",
        "batch": batch, "limits": {"decode_vs_roofline": 0.4, "matmul_peak_gflop_s": 160_000.0,
                                   "device_kind": "TPU v5 lite"}}))
    (tmp_path / "part_tests.json").write_text(json.dumps({
        "benchmark": "tpu_tests", "stage": "tests", **header, "date_utc": "2026-01-01T00:00:00Z",
        "tpu_tests": {"passed": 76, "failed": 0, "skipped": 8, "errors": 0, "failed_names": [], "skip_reasons": {
            "t.py::test_four": "Skipped: needs 4 CPU devices",
            "t.py::test_marked": "x = 1\n\n    @pytest.mark.xfail(True, strict=True, reason='known')\n"}}}))
    merged = merge_scale(load_parts(tmp_path))

    assert merged["decode_vs_roofline"] == 0.4 and merged["mixed_commits"] is False
    assert merged["train_vs_matmul_peak"] == pytest.approx(1e14 / 160e12)
    assert merged["train_vs_197_tflops"] == pytest.approx(1e14 / 197e12)
    assert merged["tpu_tests"]["failed"] == 0 and len(merged["parts"]) == 3
    # An older part counted its strict expected failure among the skips: the merge tells them apart.
    assert merged["tpu_tests"]["xfailed"] == 1 and merged["tpu_tests"]["skipped"] == 7
    assert list(merged["tpu_tests"]["xfail_reasons"]) == ["t.py::test_marked"] and merged["tpu_tests"]["corrections"]

    limits = json.loads((tmp_path / "part_limits.json").read_text())
    limits["batch"] = {**batch, "dtype": "float32"}
    (tmp_path / "part_limits.json").write_text(json.dumps(limits))
    with pytest.raises(SystemExit, match="not the rounds'"):
        merge_scale(load_parts(tmp_path))


def test_train_variants_merge_ranks_each_policy_against_the_limits_parts_matmul_peak(tmp_path):
    from bench.tpu_merge import load_parts, merge_train_variants

    shape = {"prompts": 16, "group_size": 8, "max_prompt_tokens": 64, "max_new_tokens": 128, "dtype": "bfloat16"}
    (tmp_path / "part_limits.json").write_text(json.dumps({
        "benchmark": "scale_limits", "stage": "limits", "commit": "ccc", "date_utc": "2026-01-03T00:00:00Z",
        "batch": shape, "limits": {"matmul_peak_gflop_s": 100_000.0}}))
    variants = tmp_path / "train_variants"
    variants.mkdir()
    for remat, micro, train_s in (("full", None, 2.0), ("dots", 16, 1.0)):
        (variants / f"variant_{remat}_{micro or 'whole'}.json").write_text(json.dumps({
            "commit": "ccc", "batch": {**shape, "remat": remat, "micro_batch_size": micro}, "train_s": train_s,
            "step_s": train_s + 1, "train_flops": {"flops": 1e14}, "peak_device_gib": 8.0, "planned_gib": 8.0,
            "peak_device_vs_plan": 1.0, "steps_completed": 3,
            "rounds": [{"rollout_s": 1.0, "first_step_s": 30.0}]}))
    (variants / "variant_none_16.partial.json").write_text("{}")  # a variant cut short: left out
    merged = merge_train_variants(variants, load_parts(tmp_path))

    assert [(v["remat"], v["micro_batch_size"]) for v in merged["variants"]] == [("dots", 16), ("full", None)]
    assert [v["train_vs_matmul_peak"] for v in merged["variants"]] == pytest.approx([1.0, 0.5])
    assert merged["batch"] == shape and merged["platform"] == "tpu"

    other = json.loads((variants / "variant_full_whole.json").read_text())
    other["batch"]["max_new_tokens"] = 64
    (variants / "variant_full_whole.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different batches"):
        merge_train_variants(variants, load_parts(tmp_path))


def test_identical_work_check_refuses_a_run_that_decoded_other_work():
    """A rollout with a short row, a wider prompt buffer (Tunix widens it for a long prompt) or too few
    trained tokens fails the check, naming what differed; the size's own work passes."""
    from bench.grpo_step import SIZES, identical_work

    work = SIZES["a"]
    good = {"rows": 64, "slots": 64 * 64, "tokens": 64 * 64, "min_len": 64, "max_len": 64, "prompt_width": 64}
    assert identical_work(work, [good, good], steps=2)["ok"]
    for bad, words in (({"min_len": 63, "slots": 64 * 64 - 1}, "expected 64 rows x 64"),
                       ({"prompt_width": 128}, "prompt buffer of 128"),
                       ({"tokens": 3000}, "trains on 3000")):
        check = identical_work(work, [good, {**good, **bad}], steps=2)
        assert not check["ok"] and words in " ".join(check["problems"])
    assert "1 rollouts for 2 steps" in identical_work(work, [good], steps=2)["problems"][0]


def test_scale_model_presets_change_a_presets_width_and_vocabulary_by_name():
    """bench/tpu.sh's placement-runs calibrate from the small preset at another width and at Qwen3's
    vocabulary (`small@...,vocab_size=151936`); a field the bench cannot change is refused by name."""
    from bench.scale import model_config
    from locojax.model.config import PRESETS

    wide = model_config("small@d_model=512,d_ff=2048,n_heads=8,n_kv_heads=8,vocab_size=151936")
    assert (wide.d_model, wide.d_ff, wide.n_heads, wide.vocab_size) == (512, 2048, 8, 151936)
    assert wide.n_layers == PRESETS["small"].n_layers and wide.name.startswith("small@")
    assert model_config("small") == PRESETS["small"]
    with pytest.raises(SystemExit, match="got 'rope_theta=5'"):
        model_config("small@rope_theta=5")


def test_full_ft_tells_the_engines_refusals_from_failures_and_the_merge_carries_its_answer(tmp_path):
    """bench/full_ft.py moves to a smaller preset only on the engine's own refusal (the analytic plan's,
    the compiled plan's, XLA's at compile time), whose wording it matches; lora_tpu.json gets its answer
    under `full_ft`, the fitting run's peak against its plan beside it."""
    from bench.full_ft import refusal_line
    from bench.tpu_merge import load_parts, merge_lora
    from locojax.compiled_plan import program_too_large
    from locojax.model import get_preset
    from locojax.placement.memory import plan_memory, refusal

    plan = plan_memory(get_preset("qwen3-1.7b"), rows_per_host=64, prompt_len=96, new_len=256, dtype="bfloat16",
                       remat="full", capacity_bytes=16 * 2**30, capacity_name="TPU v5 lite memory")
    assert not plan.fits
    for message in (refusal(plan), program_too_large("train", RuntimeError("RESOURCE_EXHAUSTED: 21.26G"))):
        output = f"Traceback ...\nRuntimeError: locojax train failed (status 2):\nfull: refused: {message}\n"
        assert refusal_line(output).startswith("full: refused: the run does not fit")
    assert refusal_line("Traceback ...\nJaxRuntimeError: INTERNAL: something else\n") is None

    part = {"benchmark": "full_ft", "stage": "full-ft", "commit": "abc", "date_utc": "2026-12-06T10:00:00Z",
            "platform": "tpu", "device_kind": "TPU v5 lite", "workload": {"rows": 64},
            "attempts": [{"preset": "qwen3-1.7b", "status": "refused by the memory plan", "refusal": "..."},
                         {"preset": "qwen3-0.6b", "status": "ran"}],
            "largest_preset_that_fits": "qwen3-0.6b", "run": {"steps_completed": 4, "peak_device_vs_plan": 0.95}}
    (tmp_path / "part_full-ft.json").write_text(json.dumps(part))
    merged = merge_lora(load_parts(tmp_path))
    assert merged["models"] == {} and merged["platform"] == "tpu"
    assert merged["full_ft"]["largest_preset_that_fits"] == "qwen3-0.6b"
    assert merged["full_ft"]["peak_device_vs_plan"] == 0.95 and len(merged["full_ft"]["attempts"]) == 2


@pytest.mark.slow
def test_full_ft_runs_the_first_preset_the_plan_lets_run(tmp_path):
    """A CPU dry run of bench/tpu.sh's full-ft stage on the tiny preset: one attempt, run, in the part."""
    import subprocess
    import sys

    out = tmp_path / "part_full-ft.json"
    done = subprocess.run([sys.executable, "bench/full_ft.py", "--presets", "tiny", "--prompts", "2", "--group", "2",
                           "--prompt-tokens", "16", "--new-tokens", "8", "--steps", "3", "--work", str(tmp_path / "w"),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    part = json.loads(out.read_text())
    assert part["benchmark"] == "full_ft" and part["largest_preset_that_fits"] == "tiny"
    assert [a["status"] for a in part["attempts"]] == ["ran"]
    assert part["run"]["steps_completed"] == 3 and part["run"]["planned_gib"] > 0
    assert part["workload"]["rows"] == 4 and part["commit"]


class _SidesByRows:
    """Stands in for bench/grpo_step.py's Orchestrator (which starts each side as a subprocess on the
    chip): each side runs the rows it can hold and fails above them with an error of its own; what is
    under test is which rows the search asks each side for, in what order, and what it records."""

    def __init__(self, holds):
        self.holds, self.runs, self.asked = holds, [], []

    def run(self, side, work, round_index, candidates=None):
        if candidates:  # our side's own search, in one process: the largest candidate it holds
            self.candidates = list(candidates)
            rows = max(p * work.group for p in candidates if p * work.group <= self.holds[side])
            out = {"ok": True, "rows": rows, "attempts": []}
        else:
            rows = work.rows
            ok = rows <= self.holds[side]
            out = {"ok": ok, "rows": rows, "wall_s": 1.0,
                   "error": None if ok else f"RESOURCE_EXHAUSTED: {side} at {rows} rows"}
        self.asked.append((side, rows))
        self.runs.append({"side": side, "rows": rows, "round": round_index})
        return out


@pytest.mark.parametrize("at_our_rows", [False, True])
def test_lora_rows_search_can_ask_the_peer_for_our_rows_to_record_its_own_error(at_our_rows):
    """With --peer-at-our-rows the peer first tries the rows we ran (64), where its estimate says no, and
    its failure there is recorded in its own words; then the rows its estimate accepts. Without, only
    those. Either way the rows both fit are the peer's largest, and our side runs there too."""
    from bench import grpo_step

    work = grpo_step.SIZES["lora"]  # Qwen3-1.7B: the peer's estimate accepts 16 rows of one v5e, not 24
    args = SimpleNamespace(max_prompts=8, peer_max_prompts=8, platform="tpu", peer_capacity_gib=15.75,
                           peer_at_our_rows=at_our_rows)
    fitting, _ = grpo_step.peer_candidates(work, 15.75 * 2**30, 8)
    assert fitting[0] * work.group == 16
    sides = _SidesByRows({"locojax": 64, "tunix": 16})
    record = grpo_step.search_rows(sides, work, args)

    assert [rows for side, rows in sides.asked if side == "tunix"] == ([64, 16] if at_our_rows else [16])
    attempts = record["peer"]["attempts"]
    assert [a["status"] for a in attempts] == (["failed", "ran"] if at_our_rows else ["ran"])
    if at_our_rows:
        assert attempts[0]["rows"] == 64 and attempts[0]["error"] == "RESOURCE_EXHAUSTED: tunix at 64 rows"
    assert record["peer"]["largest_rows"] == 16 and record["rows_both_fit"] == 16
    assert ("locojax", 16) in sides.asked  # our side again at the rows both fit


def test_first_step_counts_compilation_and_step_zero_not_opening_the_chip_or_building_the_model():
    """scale_tpu.json's first_step_s_* start where issue 37's clock does: the chip open and the model built."""
    from bench.scale import loop_first_step_s

    parts = {"time/setup_backend": 7.0, "time/setup_compile": 25.5, "time/setup_model": 11.5}
    figures = {"first_step_s": 44.0 + 2.5, "setup_parts_s": parts}
    assert loop_first_step_s(figures) == pytest.approx(25.5 + 2.5)
    # An engine that did not name its setup's parts cannot be read on this clock.
    assert loop_first_step_s({"first_step_s": 46.5, "setup_parts_s": {"time/setup_compile": 25.5}}) is None
    assert loop_first_step_s({"first_step_s": None, "setup_parts_s": parts}) is None


def test_our_rows_search_tries_only_rows_that_split_into_whole_micro_batches():
    """--micro-batch-size 16 (the 4B LoRA step at 64 rows): our side's candidates leave out 24 rows, which
    the engine would refuse to split into micro-batches of 16, and keep 8, which trains as one."""
    import dataclasses

    from bench import grpo_step

    work = dataclasses.replace(grpo_step.SIZES["lora"], preset="qwen3-4b", micro_batch_size=16)
    sides = _SidesByRows({"locojax": 64, "tunix": 8})
    args = SimpleNamespace(max_prompts=8, peer_max_prompts=8, platform="tpu", peer_capacity_gib=15.75,
                           peer_at_our_rows=False)
    grpo_step.search_rows(sides, work, args)
    assert [p * work.group for p in sides.candidates] == [64, 48, 32, 16, 8]
    assert work.scale_args(3).micro_batch_size == 16  # what bench/scale.py's make_spec puts in algo
    assert grpo_step.make_spec(dataclasses.replace(grpo_step.SIZES["a"], micro_batch_size=32), 3).algo.micro_batch_size == 32
