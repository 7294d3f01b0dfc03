"""`python -m locojax.placement.probe`: the probe's worker processes (started by the probe itself)."""

from __future__ import annotations

import json
import os
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, help="worker processes of `locojax probe`")


@app.command("all-reduce-worker")
def all_reduce_worker_command(
    port: Annotated[int, typer.Option(help="process 0's coordinator port on 127.0.0.1")],
    process_id: Annotated[int, typer.Option(help="0 or 1")],
    iterations: Annotated[int, typer.Option(help="timed repeats per payload")] = 20,
) -> None:
    """One of the two processes of the all-reduce measurement; prints its timings as JSON."""
    from locojax.placement.probe.machine import all_reduce_worker

    print(json.dumps(all_reduce_worker(process_id, port, iterations)), flush=True)


@app.command("kernel-worker")
def kernel_worker_command(
    kernels: Annotated[str, typer.Option(help="JSON list of kernels (see kernel_list)")],
    devices: Annotated[int, typer.Option(help="CPU devices of this process")] = 1,
    cache_dir: Annotated[Optional[str], typer.Option(help="persistent JAX compilation cache shared by the workers")] = None,
    core: Annotated[Optional[int], typer.Option(help="pin this process to one core (before JAX starts)")] = None,
    first: Annotated[int, typer.Option(help="index of the kernel this process compiles first")] = 0,
) -> None:
    """A process holding compiled engine kernels, timed on request over stdin/stdout."""
    if core is not None:
        os.sched_setaffinity(0, [core])
    from locojax.placement.probe.kernels import kernel_worker

    kernel_worker(devices, json.loads(kernels), cache_dir, first)


if __name__ == "__main__":
    app()
