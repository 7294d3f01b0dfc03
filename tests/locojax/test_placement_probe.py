"""`locojax probe` on this machine: real measurements, a real 2-process all-reduce (slow)."""

from __future__ import annotations

import json

import pytest

from locojax.placement import PlacementRequest, load_local_cpu_profile, recommend
from locojax.placement.probe import run_probe, write_probe


@pytest.mark.slow
@pytest.mark.multiprocess
def test_probe_measures_and_writes_a_usable_local_profile(tmp_path):
    result = run_probe(quick=True)
    measured = result["measurements"]
    # Orders of magnitude any CPU this runs on satisfies; zeros or NaNs mean a broken measurement.
    assert 1e8 < measured["matmul_flops"] < 1e14
    assert 1e8 < measured["memory_bandwidth"] < 1e13
    assert 0 < measured["dispatch_s"] < 0.1
    assert 0 < measured["regex_parse_s"] < 1e-3
    assert 0 < measured["all_reduce_small_s"] < measured["all_reduce_large_s"] < 10

    path = write_probe(result, tmp_path / "local-cpu.json")
    assert json.loads(path.read_text())["machine"]["cores"] >= 1
    kernels = measured["kernels_pinned"]
    assert {k["kind"] for k in kernels} == {"train", "generate"} and all(0 < k["s"] < 60 for k in kernels)
    profile = load_local_cpu_profile(path)
    rates = profile.measured_rates["64"]  # the tiny preset's width
    assert profile.rates_include_memory and 0 < rates["train_mfu"] <= 1 and 0 < rates["decode_mfu"] <= 1
    assert 0 < rates["train_attention_efficiency"] <= 1 and rates["decode_row_overhead_s"] >= 0
    # A model of the measured width takes the measured entry.
    assert profile.rates_for(64).train_mfu == rates["train_mfu"]
    request = PlacementRequest(model="tiny", hardware="local-cpu", chips=2, workload="arith")
    assert recommend(request, profile).choice.step_time_s > 0


def test_fit_recovers_the_rates_it_was_generated_with():
    from locojax.model.config import PRESETS
    from locojax.placement.cost_model import ModelSize, decode_step_flops, prefill_flops, train_flops
    from locojax.placement.hardware import LOCAL_CPU
    from locojax.placement.probe import fit_kernel_rates, kernel_list

    a, b, d, row, step, fixed, prefill, scored = 1 / 30e9, 1 / 6e9, 1 / 9e9, 4e-6, 2e-5, 3e-3, 1 / 20e9, 7e-6
    model = ModelSize.from_config(PRESETS["tiny"])
    timings = []
    for kernel in kernel_list(("tiny",)):
        batch, prompt_len, new_tokens = kernel["shape"]
        if kernel["kind"] == "train":
            param, attention = train_flops(model, LOCAL_CPU, batch, prompt_len + new_tokens, new_tokens)
            seconds = fixed + a * param + b * attention + scored * batch * new_tokens
        else:
            pf_param, pf_attention = prefill_flops(model, batch, prompt_len, prompt_len + new_tokens)
            dec_param, dec_attention = decode_step_flops(model, batch, prompt_len + new_tokens)
            seconds = (prefill * (pf_param + pf_attention * b / a) + (new_tokens - 1) * (a * dec_param + d * dec_attention)
                       + new_tokens * (batch * row + step))
        timings.append({**kernel, "s": seconds})
    rates = fit_kernel_rates(timings, matmul_flops=200e9, cores=2)["64"]
    assert rates["peak_flops"] * rates["train_mfu"] / 2 == pytest.approx(30e9, rel=1e-3)
    assert rates["peak_flops"] * rates["prefill_mfu"] / 2 == pytest.approx(20e9, rel=1e-3)
    assert rates["train_attention_efficiency"] == pytest.approx(6 / 30, rel=1e-3)
    assert rates["decode_attention_efficiency"] == pytest.approx(9 / 30, rel=1e-3)
    assert rates["decode_row_overhead_s"] == pytest.approx(row, rel=1e-3)
    assert rates["decode_step_overhead_s"] == pytest.approx(step, rel=1e-3)
    assert rates["train_step_overhead_s"] == pytest.approx(fixed, rel=1e-3)
    assert rates["train_scored_token_overhead_s"] == pytest.approx(scored, rel=1e-3)


def test_contention_counts_other_work_not_our_own_threads():
    from locojax.placement.probe import contention

    assert contention(10.0, cpu_s=10.0, wait_s=0.0, cores=1) == 1.0  # had its core
    assert contention(10.0, cpu_s=4.0, wait_s=6.0, cores=1) == pytest.approx(2.5)  # ran 40% of the time it wanted
    # Three runnable threads on two cores: waiting for each other is not other work's doing.
    assert contention(10.0, cpu_s=20.0, wait_s=10.0, cores=2) == 1.0
    assert contention(10.0, cpu_s=10.0, wait_s=20.0, cores=2) == pytest.approx(2.0)
    assert contention(10.0, cpu_s=0.0, wait_s=0.0, cores=2) == 1.0


def test_span_contention_is_the_slowest_step_process():
    from locojax.placement.probe import span_contention, work_totals

    ns = 1e9
    before = {}
    after = {
        (1, 10): (int(4 * ns), int(5 * ns)),  # a CO host: runnable 9 of 10 s, contention 2.25
        (2, 20): (int(3 * ns), int(6 * ns)),  # the other host: contention 3 (its core is busier)
        (3, 30): (int(1 * ns), int(2 * ns)),  # an actor idle most of the span: not a step process
        (1, 11): (int(0.01 * ns), int(0.5 * ns)),  # a helper thread: ignored
    }
    totals = work_totals(before, after, 10.0)
    assert sorted(p["pid"] for p in totals["processes"]) == [1, 2] and totals["work_processes"] == 3
    assert span_contention(totals) == pytest.approx(3.0, rel=1e-6)
