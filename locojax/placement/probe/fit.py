"""The fit: kernel timings -> the cost model's CPU rate fields per model width, and the `local-cpu`
profile from a probe's measurements."""

from __future__ import annotations

from typing import Any

from locojax.placement.probe.machine import LARGE_ALL_REDUCE_BYTES, SMALL_ALL_REDUCE_BYTES
from locojax.placement.workloads import REFERENCE_REGEX_PARSE_S


def fit_kernel_rates(timings: list[dict[str, Any]], matmul_flops: float, cores: int) -> dict[str, dict[str, float]]:
    """Per model width, the cost model's CPU rate fields from kernel timings (see the section comment).

    Rates are per device while every core is busy; the profile states them for the whole machine
    (`peak_flops` is shared by the busy chips), so per-device FLOP/s are multiplied by `cores`.
    Least squares on relative errors, within physical bounds: no kernel's matmuls run faster than the
    probe's large float32 matmul (`matmul_flops / cores` per device), and attention runs no faster
    than the matmuls (efficiency <= 1); overheads are >= 0. The kernels' shapes alone leave the
    matmul and attention terms nearly collinear, and without the bounds one probe of this machine
    fitted matmuls at 15x the measured peak with attention at 0.7% of it.
    """
    import numpy as np
    from scipy.optimize import least_squares, lsq_linear

    from locojax.model.config import PRESETS
    from locojax.placement.cost_model import ModelSize, decode_step_flops, prefill_flops, train_flops
    from locojax.placement.hardware import LOCAL_CPU

    def solve(rows: list[list[float]], targets: list[float], lower: list[float]) -> list[float]:
        a, y = np.asarray(rows, float), np.asarray(targets, float)
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        # Each kernel's error weighs 1/sqrt(its time): relative errors alone let the many short kernels
        # (where fixed costs rule) outvote the long ones that real steps are made of; absolute errors
        # alone would drop the short ones.
        weight = (y * np.median(y)) ** -0.5
        design, bounds = a / scale * weight[:, None], (np.asarray(lower) * scale, np.inf)
        start = np.clip(lsq_linear(design, y * weight, bounds=bounds).x, bounds[0], np.inf)
        # A robust loss: a kernel that ran through one of this VM's slow spells (which the scheduler's
        # accounting does not show: 0.47 s against 0.33 s in the other probes) counts linearly
        # beyond ~5% error instead of pulling the fit with its square.
        fit = least_squares(lambda x: design @ x - y * weight, start, bounds=bounds, loss="soft_l1", f_scale=0.05)
        return list(fit.x / scale)

    fastest = cores / matmul_flops  # seconds per FLOP of one device's share of the measured matmul peak

    out: dict[str, dict[str, float]] = {}
    for preset in dict.fromkeys(k["preset"] for k in timings):
        model = ModelSize.from_config(PRESETS[preset])
        mine = [k for k in timings if k["preset"] == preset]
        rows, targets = [], []
        for k in (k for k in mine if k["kind"] == "train"):
            batch, prompt_len, new_tokens = k["shape"]
            param, attention = train_flops(model, LOCAL_CPU, batch, prompt_len + new_tokens, new_tokens)
            # attention's seconds per FLOP b = a + extra, extra >= 0; then the per-scored-slot work
            # that is not a matmul (HardwareProfile.train_scored_token_overhead_s)
            rows.append([1.0, param + attention, attention, batch * new_tokens])
            targets.append(k["s"])
        train_fixed, a, extra, per_scored = solve(rows, targets, [0.0, fastest, 0.0, 0.0])
        b = a + extra
        rows, targets = [], []
        for k in (k for k in mine if k["kind"] == "generate"):
            batch, prompt_len, new_tokens = k["shape"]
            context = prompt_len + new_tokens  # dense attention over every cache slot (cost_model.decode_context)
            pf_param, pf_attention = prefill_flops(model, batch, prompt_len, context)
            dec_param, dec_attention = decode_step_flops(model, batch, context)
            # decode's matmuls and the floor of its attention at training's matmul rate a
            known = (new_tokens - 1) * a * (dec_param + dec_attention)
            prefill = pf_param + pf_attention * b / a
            rows.append([prefill, (new_tokens - 1) * dec_attention, new_tokens * batch, new_tokens])
            targets.append(max(k["s"] - known, 0.05 * k["s"]))
        p, d_extra, row_s, step_s = solve(rows, targets, [fastest, 0.0, 0.0, 0.0])
        d = a + d_extra
        rate = 1.0 / a if a > 0 else matmul_flops / cores  # per device, while all cores are busy
        peak = max(matmul_flops, rate * cores, cores / p if p > 0 else 0.0)

        def efficiency(seconds_per_flop: float) -> float:
            """Attention's rate relative to the matmul rate, in [1e-3, 1] (1 when the fit found no cost)."""
            return min(1.0, max(1e-3, 1.0 / seconds_per_flop / rate)) if seconds_per_flop > 0 else 1.0

        out[str(model.d_model)] = {
            "peak_flops": peak,
            "train_mfu": rate * cores / peak,
            "decode_mfu": rate * cores / peak,  # decode's matmuls at training's rate; the rest is row overhead
            "prefill_mfu": cores / p / peak if p > 0 else rate * cores / peak,
            "train_attention_efficiency": efficiency(b),
            "decode_attention_efficiency": efficiency(d),
            "decode_row_overhead_s": row_s,
            "decode_step_overhead_s": step_s,
            "train_step_overhead_s": train_fixed,
            "train_scored_token_overhead_s": per_scored,
        }
    return out


def profile_from_measurements(measurements: dict[str, Any], cores: int) -> dict[str, Any]:
    """The `local-cpu` profile fields (with their sources) from `run_probe`'s measurements."""
    measured_rates = fit_kernel_rates(measurements["kernels_pinned"], measurements["matmul_flops"], cores)
    first = next(iter(measured_rates.values()))
    profile: dict[str, Any] = {
        **first,  # models of another width take their nearest measured width (HardwareProfile.rates_for)
        "measured_rates": measured_rates,
        "rates_include_memory": True,
        "hbm_bandwidth": measurements["memory_bandwidth"],
        "ici_bandwidth": measurements["memory_bandwidth"],  # devices of one process share memory
        "pcie_bandwidth": measurements["memory_bandwidth"],
        "dispatch_s": measurements["dispatch_s"],
        "reward_cpu_scale": measurements["regex_parse_s"] / REFERENCE_REGEX_PARSE_S,
        "machine_cores": cores,
    }
    if "all_reduce_small_s" in measurements:
        small, large = measurements["all_reduce_small_s"], measurements["all_reduce_large_s"]
        # The cost model charges a 2-process ring all-reduce 2 latencies plus S bytes through a NIC.
        profile["dcn_latency_s"] = small / 2
        profile["dcn_bandwidth_per_chip"] = (LARGE_ALL_REDUCE_BYTES - SMALL_ALL_REDUCE_BYTES) / max(large - small, 1e-9)
    sources = {field: "locojax probe" for field in profile}
    presets = ", ".join(dict.fromkeys(k["preset"] for k in measurements["kernels_pinned"]))
    sources["rates"] = (f"locojax probe: the engine's train step and rollout of {presets} timed on every core at "
                        "once, on cores free of other work (schedstat), fitted per model width")
    return {**profile, "sources": sources}
