"""`locojax worker`: run a host worker (joined to the CLI through the `locojax.commands` entry point)."""

from __future__ import annotations

import socket
from typing import Annotated

import typer

from locojax.contract import EXIT_SPEC_ERROR


def worker(
    name: Annotated[str, typer.Option(help="host name; the worker consumes queue host.<name>")] = socket.gethostname(),
    url: Annotated[str, typer.Option("--url", envvar="LOCOJAX_URL", help="control-plane URL")] = "http://127.0.0.1:8000",
    token: Annotated[str | None, typer.Option("--token", envvar="LOCOJAX_TOKEN", show_default=False,
                                              help="a worker-scoped token (locojax token create --scope worker)")] = None,
    broker_url: Annotated[str, typer.Option("--broker-url", envvar="LOCOJAX_BROKER_URL",
                                            help="Celery broker (redis://... in production)")] = "",
    address: Annotated[str, typer.Option(help="address peers use to reach this host's JAX coordinator")] = "127.0.0.1",
    devices: Annotated[int | None, typer.Option(min=1, help="accelerator devices of this host (CPU: simulated); "
                                                          "default: as many as JAX finds")] = None,
    device_kind: Annotated[str | None, typer.Option(help="the hardware profile of the devices, e.g. tpu-v5e, h100, "
                                                         "local-cpu; default: JAX is asked at start")] = None,
    cores: Annotated[str | None, typer.Option(help="pin this worker and its engine processes to these cores, e.g. 0,1")] = None,
    heartbeat_s: Annotated[float, typer.Option(min=0.1, help="seconds between heartbeats")] = 2.0,
    slice_name: Annotated[str | None, typer.Option("--slice", help="the TPU slice (or group) this host belongs to")] = None,
    reward_modules: Annotated[str, typer.Option(
        "--reward-modules", envvar="LOCOJAX_REWARD_MODULES",
        help="module prefixes custom rewards may be imported from (the API's list); engine processes check it")] = "",
    runs_root: Annotated[str, typer.Option(
        "--runs-root", envvar="LOCOJAX_RUNS_ROOT",
        help="the API's runs_root as seen from this host: engine processes write only under it")] = "runs",
    ray_address: Annotated[str, typer.Option(
        "--ray-address", envvar="LOCOJAX_RAY_ADDRESS",
        help="an operator-run Ray cluster for DA runs; default: a private one per run on this host")] = "",
    compilation_cache: Annotated[str, typer.Option(
        "--compilation-cache", envvar="LOCOJAX_COMPILATION_CACHE",
        help="folder of compiled programs this host's runs share (default: the engine's, "
             "~/.locojax/compilation-cache)")] = "",
) -> None:
    """Run a host worker: registers this host, heartbeats, and starts engine host processes for the
    runs the scheduler places here."""
    import logging
    import os
    from pathlib import Path

    from locojax.client import ApiClient
    from locojax.rewards import split_prefixes
    from worker.app import run_worker
    from worker.hardware import HardwareError, host_hardware
    from worker.supervisor import engine_environment

    if not token:
        typer.echo("no token: pass --token or set LOCOJAX_TOKEN (locojax token create --scope worker)", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    if not broker_url:
        typer.echo("no broker: pass --broker-url or set LOCOJAX_BROKER_URL (the API's broker)", err=True)
        raise typer.Exit(EXIT_SPEC_ERROR)
    try:
        pinned = [int(part) for part in cores.split(",")] if cores else None
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list of core numbers: {cores!r}", param_hint="--cores") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine_env = engine_environment(os.environ)
    try:  # before any engine process exists: the child that asks JAX has exited when this returns
        hardware = host_hardware(device_kind, devices, env=engine_env)
    except HardwareError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(EXIT_SPEC_ERROR) from None
    logging.getLogger("locojax.worker").info("devices: %d x %s%s", hardware.device_count, hardware.hardware,
                                             f" ({hardware.jax_device_kind})" if hardware.jax_device_kind else "")
    with ApiClient(url, token, timeout=10.0) as api:
        run_worker(name, api, broker_url, address=address, devices=hardware.device_count, cores=pinned,
                   heartbeat_s=heartbeat_s, slice_name=slice_name, device_kind=hardware.hardware,
                   device_memory_bytes=hardware.device_memory_bytes, device_info=hardware.info(),
                   reward_modules=split_prefixes(reward_modules), ray_address=ray_address, engine_env=engine_env,
                   runs_root=Path(os.path.abspath(runs_root)),
                   compilation_cache=os.path.abspath(compilation_cache) if compilation_cache else "")


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
