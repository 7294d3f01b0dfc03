"""Start H simulated hosts on this machine: H `locojax host` processes joined by `jax.distributed`.

On a real slice each TPU VM runs `locojax host --process-id i ...` itself; this module does the same
on one machine for development, tests and benchmarks. Each process gets `devices_per_host` CPU
devices and its own cores, a free loopback port is chosen for the coordinator, and when one host
fails the others are stopped at once (a JAX job has no elastic recovery: PITFALLS.md), so a failure
ends the launch in seconds instead of after the coordination service's heartbeat timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cores_for_host(host: int, hosts: int, cpu_count: int | None = None) -> list[int]:
    """Cores host `host` is pinned to: an even split of the machine, wrapping when hosts > cores."""
    available = sorted(os.sched_getaffinity(0)) if cpu_count is None else list(range(cpu_count))
    if hosts >= len(available):
        return [available[host % len(available)]]
    per_host = len(available) // hosts
    return available[host * per_host:(host + 1) * per_host]


def host_command(spec_path: str | Path, process_id: int, num_processes: int, coordinator: str,
                 devices_per_host: int, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "locojax.cli", "host", str(spec_path), "--process-id", str(process_id),
            "--num-processes", str(num_processes), "--coordinator", coordinator,
            "--devices-per-host", str(devices_per_host), *extra]


class LaunchError(RuntimeError):
    """A host process failed; the message names the host and its exit status."""


@dataclass
class HostProcess:
    index: int
    process: subprocess.Popen
    cores: list[int]


def _stop(hosts: Sequence[HostProcess], grace_s: float = 5.0) -> None:
    """SIGTERM every live host's process group, then SIGKILL what is left after `grace_s`."""
    for host in hosts:
        if host.process.poll() is None:
            with _suppress_lookup():
                os.killpg(host.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for host in hosts:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            host.process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            with _suppress_lookup():
                os.killpg(host.process.pid, signal.SIGKILL)
            host.process.wait()


class _suppress_lookup:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is ProcessLookupError


def _where(status_dir: Path | None, host: int) -> str:
    if status_dir is None:
        return ""
    from locojax.contract import read_host_status

    status = read_host_status(status_dir, host)
    return f" during {status['phase']} of step {status['step']}" if status else " during start-up"


def launch(spec_path: str | Path, hosts: int, devices_per_host: int = 1, extra: Sequence[str] = (),
           poll_s: float = 0.05, log_dir: str | Path | None = None, status_dir: str | Path | None = None) -> list[int]:
    """Run `hosts` host processes to completion; returns their exit codes: each EXIT_OK, or
    EXIT_CANCELLED when the hosts stopped at a step boundary on a cancel (they agree on it).

    Raises LaunchError naming the first host that failed (and, given `status_dir`, the phase it was
    in: the run's output directory, where hosts record their step and phase), after stopping the
    others.
    """
    from locojax.contract import EXIT_CANCELLED, EXIT_OK

    coordinator = f"127.0.0.1:{free_port()}"
    started: list[HostProcess] = []
    logs = []
    try:
        for index in range(hosts):
            cores = cores_for_host(index, hosts)
            command = host_command(spec_path, index, hosts, coordinator, devices_per_host, extra)
            stdout = None
            if log_dir is not None:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                stdout = open(Path(log_dir) / f"host{index}.log", "ab")
                logs.append(stdout)
            process = subprocess.Popen(
                command,
                stdout=stdout,
                stderr=subprocess.STDOUT if stdout else None,
                start_new_session=True,  # its own process group, so a stop reaches its children too
                preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores),
            )
            started.append(HostProcess(index, process, cores))

        while True:
            codes = [host.process.poll() for host in started]
            failed = [(host, code) for host, code in zip(started, codes)
                      if code not in (None, EXIT_OK, EXIT_CANCELLED)]
            if failed:
                host, code = failed[0]
                _stop(started)
                reason = f"signal {-code}" if code < 0 else f"exit status {code}"
                where = _where(Path(status_dir) if status_dir else None, host.index)
                raise LaunchError(f"host {host.index} (pid {host.process.pid}) failed with {reason}{where}; "
                                  f"stopped the other {hosts - 1} host(s)")
            if all(code is not None for code in codes):
                return codes
            time.sleep(poll_s)
    except BaseException:
        _stop(started)
        raise
    finally:
        for log in logs:
            log.close()
