"""Small helpers for tests that drive a live control plane over REST: a tiny run spec, polling, and
what the process table says. Shared by tests/worker and tests/e2e (and bench/reliability.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from locojax.client import TERMINAL, ApiClient


def tiny_spec(name: str, *, hosts: int, steps: int, every: int = 0, **extra: Any) -> dict[str, Any]:
    """A CO run of the tiny model on generated arithmetic: a few seconds per step on one CPU core."""
    return {
        "name": name, "seed": 0, "model": {"preset": "tiny"}, "task": {"name": "arith", "difficulty": 1},
        "rollout": {"prompts_per_step": 4, "group_size": 2, "max_prompt_tokens": 48, "max_new_tokens": 6},
        "optim": {"lr": 3e-4, "warmup_steps": 0}, "steps": steps,
        "placement": {"mode": "co", "hosts": hosts, "devices_per_host": 1},
        "checkpoint": {"every": every, "keep": 2}, **extra,
    }


def wait_until(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_final(api: ApiClient, run_id: int, timeout_s: float = 300.0) -> dict[str, Any]:
    return wait_until(lambda: (run := api.get_run(run_id))["status"] in TERMINAL and run,
                      timeout_s, f"run {run_id} to finish")


def last_step(api: ApiClient, run_id: int) -> int:
    step = api.metric_summary(run_id)["last_step"]
    return -1 if step is None else step


def steps_of(api: ApiClient, run_id: int, key: str, host: int) -> list[int]:
    series = api.metric_history(run_id, [key], hosts=[host], max_points=10_000)["series"]
    return series[0]["steps"] if series else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it holds nothing, and its parent (the worker) reaps it.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def host_pids(api: ApiClient, run_id: int, attempt: int | None = None) -> list[int]:
    return [row["pid"] for row in api.list_run_hosts(run_id, attempt) if row["pid"]]


def placed_sink(stack: Any, api: ApiClient, name: str) -> dict[str, Any]:
    """A run that never starts (it needs more hosts than the plane has) whose process 0 is placed on the
    plane's first host, as the scheduler would: the plane's worker token (bound to its hosts) may then
    report metrics for it, for attempt 0. Scenarios that only exercise ingest write into it; cancel it
    when done."""
    run = api.submit(tiny_spec(name, hosts=len(stack.plane.host_names) + 1, steps=1))
    stack.sql("INSERT INTO run_hosts (run_id, attempt, process_index, host_name, role, status, updated_at) "
              "VALUES (:id, 0, 0, :host, 'co', 'RUNNING', now())", id=run["id"], host=stack.plane.host_names[0])
    return run

