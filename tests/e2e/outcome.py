"""What every scenario returns, and the audit of a finished run that the fault and load scenarios share.

A scenario returns a plain dict (it goes straight into bench/results/reliability.json):
  passed        every check held
  recover_s     seconds to recover (what is measured is said in `details["recover"]`), None if not a fault
  metrics_lost  metric values the engine wrote (metrics.jsonl) or every step must have, missing from the
                database; must be 0
  values_reposted  values the API received beyond the lines the engine wrote (the API's own delivery
                count, `/metrics/deliveries`, minus every value of every metrics.jsonl line): retries
                and a restarted relay re-posting the file. Reported, not a failure: the upsert makes a
                repost harmless, and rows stored cannot show one (one row per step by primary key)
  checks        name -> bool, each a property the scenario asserts
  details       figures and evidence (event messages, counts, timings)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from locojax.client import ApiClient
from tests.e2e.helpers import steps_of
from tests.e2e.infra import Stack, wait_gone

# Series whose every step a finished run must hold for every host (and the aggregate, host -1).
STEP_KEYS = ("time/step", "reward/mean")


def outcome(checks: dict[str, bool], *, recover_s: float | None = None, audits: list[dict[str, Any]] = (),
            **details: Any) -> dict[str, Any]:
    lost = sum(audit["metrics_lost"] for audit in audits)
    reposted = sum(audit["values_reposted"] for audit in audits)
    checks = dict(checks)
    if audits:
        checks["no metric lost"] = lost == 0
        checks["no stale value"] = all(audit["stale_values"] == 0 for audit in audits)
        checks["every written value reached the API"] = all(not audit["series_posted_short"] for audit in audits)
        # What the old "no duplicate point" checked: the history query's doing, not delivery's.
        checks["history shows each step once"] = all(audit["points_read_twice"] == 0 for audit in audits)
        checks["no orphan process"] = all(not audit["orphans"] for audit in audits)
    return {
        "passed": all(checks.values()), "recover_s": None if recover_s is None else round(recover_s, 2),
        "metrics_lost": lost, "values_reposted": reposted, "checks": checks,
        "details": {**details, **({"runs": audits} if audits else {})},
    }


def failed(exc: BaseException, **details: Any) -> dict[str, Any]:
    """A scenario that could not complete (timed out, the plane broke) still reports, as not passed."""
    return {"passed": False, "recover_s": None, "metrics_lost": 0, "values_reposted": 0,
            "checks": {"completed": False}, "details": {"error": f"{type(exc).__name__}: {exc}", **details}}


def output_dir(stack: Stack, run: dict[str, Any]) -> Path:
    return Path(stack.settings.runs_root) / f"{run['id']}-{run['name']}"


def written_lines(path: Path) -> list[tuple[str, int, int, float]]:
    """Every (key, host, step, value) of every line the engine wrote to metrics.jsonl, in file order; a
    step written again by a later attempt appears again (finite numbers only, as the relay posts)."""
    values: list[tuple[str, int, int, float]] = []
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return values
    for line in lines:
        try:
            record = json.loads(line)
            step, host = int(record.pop("step")), record.pop("host")
        except (ValueError, KeyError, TypeError):
            continue
        host_index = -1 if host == "all" else int(host)
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                values.append((key, host_index, step, float(value)))
    return values


def written_metrics(path: Path) -> dict[tuple[str, int, int], float]:
    """(key, host, step) -> value as the engine wrote them; a step written again by a later attempt
    counts with its last value (the relay posts in file order, the API upserts)."""
    return {(key, host, step): value for key, host, step, value in written_lines(path)}


def last_written_step(stack: Stack, run: dict[str, Any]) -> int:
    """The newest aggregate step in the run's metrics.jsonl (-1 when none yet)."""
    steps = [step for (_, host, step) in written_metrics(output_dir(stack, run) / "metrics.jsonl") if host == -1]
    return max(steps, default=-1)


def audit_run(stack: Stack, api: ApiClient, run_id: int, *, hosts: int, steps: int | None = None) -> dict[str, Any]:
    """Compare what the engine wrote with what the database holds and what the API shows.

    `steps`: the steps every host must have (default: the spec's, for a run that SUCCEEDED).
    """
    run = api.get_run(run_id)
    steps = run["spec"]["steps"] if steps is None else steps
    lines = written_lines(output_dir(stack, run) / "metrics.jsonl")
    written = {(key, host, step): value for key, host, step, value in lines}
    stored = {(key, host, step): value for key, host, step, value in stack.sql(
        "SELECT key, host, step, value FROM step_metrics WHERE run_id = :run_id", run_id=run_id)}
    expected = {(key, host, step) for key in STEP_KEYS for host in (-1, *range(hosts)) for step in range(steps)}
    lost = sorted((set(written) | expected) - set(stored))
    stale = sorted(key for key, value in written.items() if key in stored and stored[key] != value)
    # What was posted, counted by the API (every retry and repeat), against what was written: each
    # series must have received at least every value of every line, and the excess is the reposts.
    posted = {(s["key"], s["host"]): s["values_posted"] for s in api.metric_deliveries(run_id)["series"]}
    written_per_series: dict[tuple[str, int], int] = {}
    for key, host, _, _ in lines:
        written_per_series[(key, host)] = written_per_series.get((key, host), 0) + 1
    short = sorted(series for series, count in written_per_series.items() if posted.get(series, 0) < count)
    # A reader sees each step once (a check of the history query, not of delivery).
    read_twice = 0
    for key in STEP_KEYS:
        for host in (-1, *range(hosts)):
            seen = steps_of(api, run_id, key, host)
            read_twice += len(seen) - len(set(seen))
    orphans = wait_gone(stack.engine_processes(str(output_dir(stack, run))), 15.0)
    return {
        "run_id": run_id, "name": run["name"], "status": run["status"], "attempt": run["attempt"],
        "restarts": run["restarts"], "steps": steps, "values_written": len(written),
        "values_written_all_lines": len(lines), "values_posted": sum(posted.values()), "values_stored": len(stored),
        "values_reposted": sum(posted.values()) - len(lines), "series_posted_short": [list(s) for s in short],
        "metrics_lost": len(lost), "lost_sample": [list(item) for item in lost[:5]], "stale_values": len(stale),
        "points_read_twice": read_twice, "orphans": orphans,
    }
