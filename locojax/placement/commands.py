"""CLI commands of the placement package: `recommend`, `sweep`, `probe`, `calibrate`.

`locojax.cli` calls `register(app)`. Heavy imports happen inside the commands so `locojax --help`
stays fast. Files are read only from paths given on the command line (the measured local profile
defaults to `~/.locojax/local-cpu.json`, used only when it exists and `local-cpu` is asked for).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from locojax.contract import EXIT_SPEC_ERROR, validation_message

LocalProfileOption = Annotated[
    Optional[Path],
    typer.Option("--local-profile", help="measured local-cpu profile (`locojax probe`); "
                                         "default ~/.locojax/local-cpu.json when it exists"),
]


CalibrationOption = Annotated[
    Optional[Path],
    typer.Option("--calibration", help="a fitted profile to price with: `locojax calibrate --out` JSON, or "
                                       "bench/results/placement_tpu.json (its `calibration`)"),
]


def _resolve_hardware(name: str, local_profile: Path | None, calibration: Path | None = None):
    from locojax.placement.hardware import HardwareProfile, default_local_cpu_path, get_hardware

    if calibration is not None:
        try:
            data = json.loads(calibration.read_text(encoding="utf-8"))
            profile = HardwareProfile.from_json(data.get("calibration", data)["profile"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"--calibration {calibration}: not a calibration with a 'profile' ({exc})") from None
        if profile.name != name:
            raise ValueError(f"--calibration {calibration}: fitted for {profile.name}, not {name}")
        return profile
    if name == "local-cpu" and local_profile is None and default_local_cpu_path().is_file():
        local_profile = default_local_cpu_path()
    return get_hardware(name, local_profile)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(EXIT_SPEC_ERROR)


def recommend_command(
    model: Annotated[str, typer.Option(help="model preset, e.g. qwen3-0.6b")],
    hardware: Annotated[str, typer.Option(help="hardware profile, e.g. tpu-v7x")],
    chips: Annotated[int, typer.Option(help="chip budget")],
    workload: Annotated[str, typer.Option(help="workload profile, e.g. gsm8k")],
    chips_per_host: Annotated[Optional[int], typer.Option(help="default: the hardware profile's")] = None,
    prompts_per_step: Annotated[Optional[int], typer.Option()] = None,
    group_size: Annotated[Optional[int], typer.Option()] = None,
    prompt_len: Annotated[Optional[int], typer.Option()] = None,
    gen_len: Annotated[Optional[int], typer.Option()] = None,
    top: Annotated[int, typer.Option(help="options shown in the table")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="print the recommendation as JSON")] = False,
    local_profile: LocalProfileOption = None,
    calibration: CalibrationOption = None,
) -> None:
    """Which coordination mode, host count and rollout share is fastest for this run."""
    from pydantic import ValidationError

    from locojax.placement.recommender import PlacementRequest, recommend

    try:
        request = PlacementRequest(model=model, hardware=hardware, chips=chips, chips_per_host=chips_per_host,
                                   workload=workload, prompts_per_step=prompts_per_step, group_size=group_size,
                                   prompt_len=prompt_len, gen_len=gen_len)
        result = recommend(request, _resolve_hardware(hardware, local_profile, calibration))
    except ValidationError as exc:
        _fail("; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {validation_message(e)}"
                        for e in exc.errors()))
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(result.model_dump_json(indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{model} on {chips} x {hardware}, {workload}")
    for column in ("rank", "mode", "chips", "hosts", "rollout", "step s", "device", "host", "network"):
        table.add_column(column, justify="right" if column not in ("mode",) else "left")
    for rank, option in enumerate(result.options[:top], start=1):
        step = option.step_time_s
        table.add_row(str(rank), option.mode.upper(), str(option.chips), str(option.hosts),
                      f"{option.rollout_fraction:.0%}" if option.rollout_fraction else "-", f"{step:.3f}",
                      f"{option.device_s / step:.0%}", f"{option.host_s / step:.0%}", f"{option.network_s / step:.0%}")
    console = Console()
    console.print(table)
    console.print(f"[bold]choice:[/bold] {result.choice.label} — {result.reason}")


def sweep_command(
    hardware: Annotated[str, typer.Option(help="hardware profile, e.g. tpu-v7x")],
    out: Annotated[Path, typer.Option(help="directory for the PNG and JSON")] = Path("sweep"),
    workload: Annotated[Optional[str], typer.Option(help="default: gsm8k (decode-heavy)")] = None,
    chips: Annotated[Optional[int], typer.Option(help="chips per point; larger models get what they need")] = None,
    local_profile: LocalProfileOption = None,
) -> None:
    """Device/host/network share of step time vs model size (0.6B to 405B) for SC and CO."""
    from locojax.placement.sweep import DEFAULT_SWEEP_CHIPS, DEFAULT_SWEEP_WORKLOAD, run_sweep, write_sweep
    from locojax.placement.workloads import get_workload

    try:
        profile = _resolve_hardware(hardware, local_profile)
        result = run_sweep(profile, get_workload(workload or DEFAULT_SWEEP_WORKLOAD),
                           chips=chips or max(DEFAULT_SWEEP_CHIPS, profile.chips_per_host))
    except ValueError as exc:
        _fail(str(exc))
    json_path, png_path = write_sweep(result, out)
    for point in result.points:
        typer.echo(f"{point.model:>15} {point.mode.upper()} {point.chips:>5} chips  step {point.step_s:9.3f} s  "
                   f"device {point.device_share:4.0%}  host {point.host_share:4.0%}  network {point.network_share:4.0%}")
    typer.echo(f"wrote {json_path} and {png_path}")


def probe_command(
    out: Annotated[Optional[Path], typer.Option(help="default: ~/.locojax/local-cpu.json")] = None,
    quick: Annotated[bool, typer.Option(help="smaller, faster measurements")] = False,
    all_reduce: Annotated[bool, typer.Option(help="measure a 2-process all-reduce")] = True,
) -> None:
    """Measure this machine (matmul, memory, dispatch, the engine's kernels, all-reduce, reward) and
    write the local-cpu profile."""
    from locojax.placement.hardware import default_local_cpu_path
    from locojax.placement.probe import run_probe, write_probe

    result = run_probe(quick=quick, all_reduce=all_reduce)
    path = write_probe(result, out or default_local_cpu_path())
    for key, value in result["measurements"].items():
        if isinstance(value, list):  # kernel timings: one line each
            for kernel in value:
                typer.echo(f"{key:>22}: {kernel['preset']} {kernel['kind']} {tuple(kernel['shape'])}: "
                           f"{kernel['s'] * 1e3:.1f} ms (wall {kernel['wall_s'] * 1e3:.1f} ms)")
        else:
            typer.echo(f"{key:>22}: {value:.4g}" if isinstance(value, float) else f"{key:>22}: {value}")
    for width, rates in result["profile"]["measured_rates"].items():
        typer.echo(f"{'measured_rates':>22}: d_model {width}: " + ", ".join(f"{k} {v:.4g}" for k, v in rates.items()))
    typer.echo(f"wrote {path}")


def calibrate_command(
    runs: Annotated[list[Path], typer.Argument(help="run directories with spec.yaml and metrics.jsonl")],
    hardware: Annotated[str, typer.Option(help="profile to refit")] = "local-cpu",
    out: Annotated[Optional[Path], typer.Option(help="write the fitted profile JSON here")] = None,
    local_profile: LocalProfileOption = None,
) -> None:
    """Refit a profile's host and network constants from measured runs and report the fit error."""
    from locojax.placement.calibration import calibrate_runs

    try:
        result = calibrate_runs(_resolve_hardware(hardware, local_profile), runs)
    except ValueError as exc:
        _fail(str(exc))
    for name, value in result.constants.items():
        typer.echo(f"{name:>34}: {value:.4g}")
    typer.echo(f"fit error (RMS share of step) before: step {result.before.step:.3f} host {result.before.host:.3f} "
               f"network {result.before.network:.3f}; after: step {result.after.step:.3f} host {result.after.host:.3f} "
               f"network {result.after.network:.3f}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("recommend")(recommend_command)
    app.command("sweep")(sweep_command)
    app.command("probe")(probe_command)
    app.command("calibrate")(calibrate_command)
