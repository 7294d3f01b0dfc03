"""Engine commands of the `locojax` CLI: train, host, launch, sft, demo.

JAX is imported inside each command: the number of CPU devices per process must be set before JAX
starts, and `locojax --help` should not pay for it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from locojax.spec import RunSpec, SpecError, load_spec, parse_spec

# Exit code of `train`/`host` after a cooperative cancel; the worker reports such a process as stopped,
# not failed (worker/protocol.py names the same value).
EXIT_CANCELLED = 3

SpecArg = typer.Argument(..., exists=False, help="run spec (YAML); see examples/")


def _load(path: Path) -> RunSpec:
    try:
        return load_spec(path)
    except SpecError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(2) from None


RewardModulesOpt = typer.Option(
    "", "--reward-modules",
    help="module prefixes (comma-separated) that `package.module:function` rewards may be imported from; "
         "default: none, registered rewards only")


def _allow_rewards(spec: RunSpec, reward_modules: str, where: str) -> None:
    """Set this process's reward allowlist and refuse a spec naming a reward outside it, before anything
    is imported: the host re-checks what the API accepted (a forged start message stops here)."""
    from locojax.rewards import allow_reward_modules, allowed_reward_modules, check_reward_names

    allow_reward_modules(reward_modules)
    refused = check_reward_names(spec.task.reward or [], allowed_reward_modules())
    if refused:
        lines = "; ".join(f"task.reward.{index}: {message}" for index, message in refused)
        typer.secho(f"{where}: refused: {lines}", fg="red", err=True)
        raise typer.Exit(2)


def configure_jax(devices_per_host: int) -> None:
    """Give this process `devices_per_host` CPU devices (ignored by accelerator backends)."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices_per_host)


def _with(spec: RunSpec, **overrides) -> RunSpec:
    """`spec` with top-level fields replaced, validated again (an override can make a spec invalid)."""
    try:
        return parse_spec({**spec.model_dump(mode="json"), **overrides}, "spec with command-line overrides")
    except SpecError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(2) from None


def train(
    spec_path: Path = SpecArg,
    resume: bool = typer.Option(False, "--resume", help="continue from the run's latest checkpoint"),
    steps: Optional[int] = typer.Option(None, help="override spec.steps"),
    output_dir: Optional[Path] = typer.Option(None, help="override spec.output_dir (default runs/<name>)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
    cancel_file: Optional[Path] = typer.Option(None, help="stop at the next step boundary once this file exists "
                                                           "(exit code 3)"),
    reward_modules: str = RewardModulesOpt,
    ray_address: Optional[str] = typer.Option(None, "--ray-address",
                                              help="DA: the operator's Ray cluster; default: a private one here"),
) -> None:
    """Train a run (GRPO, or SFT for `kind: sft`): in this process when it has one host, else start its
    hosts with `launch`."""
    spec = _load(spec_path)
    overrides = {k: v for k, v in {"steps": steps, "output_dir": str(output_dir) if output_dir else None}.items()
                 if v is not None}
    if overrides:
        spec = _with(spec, **overrides)
    _allow_rewards(spec, reward_modules, str(spec_path))
    placement = spec.placement
    if spec.kind == "grpo" and placement.mode == "co" and placement.hosts > 1:
        _launch_spec(spec, placement.hosts, placement.devices_per_host, resume, quiet, cancel_file, reward_modules)
        return
    single_host = spec.kind == "sft" or placement.mode == "co"
    configure_jax(placement.devices_per_host if single_host else placement.hosts * placement.devices_per_host)
    from locojax.modes import run_mode
    from locojax.modes.da import DAError

    try:
        extra = {"ray_address": ray_address} if ray_address and spec.kind == "grpo" and placement.mode == "da" else {}
        result = run_mode(spec, resume=resume, console=not quiet, cancel_file=cancel_file, **extra)
    except DAError as exc:
        typer.secho(f"{spec.name}: failed: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{spec.name}: {result.status} after {result.steps_done} steps")
    if result.status == "cancelled":
        raise typer.Exit(EXIT_CANCELLED)


def host(
    spec_path: Path = SpecArg,
    process_id: int = typer.Option(0, help="this host's index in the job"),
    num_processes: int = typer.Option(1, help="hosts in the job"),
    coordinator: Optional[str] = typer.Option(None, help="ADDR:PORT of process 0's coordination service"),
    devices_per_host: int = typer.Option(1, help="CPU devices to simulate in this process"),
    resume: bool = typer.Option(False, "--resume"),
    cancel_file: Optional[Path] = typer.Option(None, help="stop at the next step boundary once this file exists"),
    quiet: bool = typer.Option(False, "--quiet"),
    reward_modules: str = RewardModulesOpt,
) -> None:
    """Run one host of a multi-host job: what every TPU VM (or simulated host) runs. An SFT spec
    (`kind: sft`) runs here too, as the single host of its job."""
    spec = _load(spec_path)
    _allow_rewards(spec, reward_modules, str(spec_path))
    if spec.kind == "sft" and num_processes > 1:
        typer.secho(f"{spec_path}: placement.hosts must be 1 for an SFT run (kind 'sft' is single-host), "
                    f"but this host was started as one of --num-processes {num_processes}", fg="red", err=True)
        raise typer.Exit(2)
    configure_jax(devices_per_host)
    import jax

    if num_processes > 1:
        if not coordinator:
            typer.secho("--coordinator is required with --num-processes > 1", fg="red", err=True)
            raise typer.Exit(2)
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    from locojax.modes import run_mode

    kwargs = {"resume": resume, "console": not quiet and process_id == 0}
    if cancel_file is not None:
        kwargs["cancel_file"] = cancel_file
    result = run_mode(spec, **kwargs)
    if process_id == 0:
        typer.echo(f"{spec.name}: {result.status} after {result.steps_done} steps")
    if num_processes > 1:
        jax.distributed.shutdown()
    if result.status == "cancelled":
        raise typer.Exit(EXIT_CANCELLED)


def _launch_spec(spec: RunSpec, hosts: int, devices_per_host: int, resume: bool, quiet: bool,
                 cancel_file: Path | None = None, reward_modules: str = "") -> None:
    import tempfile

    from locojax.launch import LaunchError, launch
    from locojax.modes.run_files import output_dir
    from locojax.spec import dump_spec

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        handle.write(dump_spec(spec))
    extra = (["--resume"] if resume else []) + (["--quiet"] if quiet else [])
    extra += ["--reward-modules", reward_modules] if reward_modules else []
    # Every host watches the same file; CO hosts agree on it in their per-step gather.
    extra += ["--cancel-file", str(cancel_file)] if cancel_file is not None else []
    try:
        launch(handle.name, hosts, devices_per_host, extra, status_dir=output_dir(spec))
    except LaunchError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(1) from None
    finally:
        Path(handle.name).unlink(missing_ok=True)


def launch_command(
    spec_path: Path = SpecArg,
    hosts: int = typer.Option(..., help="host processes to start on this machine"),
    devices_per_host: int = typer.Option(1, help="CPU devices per host process"),
    resume: bool = typer.Option(False, "--resume"),
    quiet: bool = typer.Option(False, "--quiet"),
    reward_modules: str = RewardModulesOpt,
) -> None:
    """Start HOSTS `locojax host` processes here (pinned to their own cores, on a free loopback port);
    if one fails, the rest are stopped and the failure is reported."""
    spec = _load(spec_path)
    spec = _with(spec, placement={**spec.placement.model_dump(), "hosts": hosts, "devices_per_host": devices_per_host})
    _allow_rewards(spec, reward_modules, str(spec_path))
    _launch_spec(spec, hosts, devices_per_host, resume, quiet, reward_modules=reward_modules)


def sft(
    spec_path: Path = SpecArg,
    out: Optional[Path] = typer.Option(None, help="the run's output directory (default: spec.output_dir or "
                                       "runs/<name>); the model a GRPO spec's model.checkpoint names is <out>/model"),
    steps: Optional[int] = typer.Option(None, help="SFT steps (default: spec.steps)"),
    batch_size: Optional[int] = typer.Option(None, help="examples per step (default: rollout.prompts_per_step)"),
    lr: Optional[float] = typer.Option(None, help="learning rate (default: optim.lr)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run's latest checkpoint"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
) -> None:
    """Warm-start a policy with teacher-forced SFT on the spec's task reference answers.

    The same as `locojax train` on the spec with `kind: sft` (any spec works: a GRPO spec is run as SFT);
    the options override the spec's fields. Writes metrics.jsonl and checkpoints like any run, and
    exports <out>/model when done."""
    spec = _load(spec_path)
    rollout = {**spec.rollout.model_dump(), **({"prompts_per_step": batch_size} if batch_size else {})}
    optim = {**spec.optim.model_dump(), **({"lr": lr} if lr else {})}
    overrides = {"kind": "sft", "rollout": rollout, "optim": optim,
                 "placement": {**spec.placement.model_dump(), "mode": "co", "hosts": 1, "rollout_fraction": None}}
    if steps is not None:
        overrides["steps"] = steps
    if out is not None:
        overrides["output_dir"] = str(out)
    spec = _with(spec, **overrides)
    configure_jax(spec.placement.devices_per_host)
    from locojax import metrics as m
    from locojax.sft import export_dir, run_sft

    result = run_sft(spec, resume=resume, console=not quiet)
    loss = result.final_metrics.get(m.LOSS_SFT, float("nan"))
    typer.echo(f"sft: {result.status}, loss {loss:.4f} after {result.steps_done} steps -> {export_dir(spec)}")


def demo(
    out: Path = typer.Option(Path("runs/demo"), help="where the demo writes checkpoints, metrics and a plot"),
    sft_steps: Optional[int] = typer.Option(None, help="SFT warm-start steps (default: the demo's)"),
    grpo_steps: Optional[int] = typer.Option(None, help="GRPO steps (default: the demo's)"),
    seed: int = typer.Option(0),
    quiet: bool = typer.Option(False, "--quiet"),
) -> None:
    """The newcomer's demo: SFT warm start, then GRPO on `arith` with the `small` preset, locally."""
    configure_jax(1)
    from locojax.demo import run_demo

    kwargs = {k: v for k, v in {"sft_steps": sft_steps, "grpo_steps": grpo_steps}.items() if v is not None}
    summary = run_demo(out, console=not quiet, seed=seed, **kwargs)
    typer.echo(summary)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("host")(host)
    app.command("launch")(launch_command)
    app.command("sft")(sft)
    app.command("demo")(demo)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
