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
    assert 1e7 < measured["decode_flops_per_s"] < 1e14 and measured["decode_step_fixed_s"] >= 0
    assert 1e7 < measured["train_flops_per_s"] < 1e14 and measured["train_step_fixed_s"] >= 0
    profile = load_local_cpu_profile(path)
    assert profile.peak_flops == measured["decode_flops_per_s"] and 0 < profile.train_mfu <= 1
    assert profile.dcn_latency_s == pytest.approx(measured["all_reduce_small_s"] / 2)
    request = PlacementRequest(model="tiny", hardware="local-cpu", chips=2, workload="arith")
    assert recommend(request, profile).choice.step_time_s > 0
