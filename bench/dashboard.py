"""Dashboard run page server time with 100,000 stored metric rows (issue 9: p95 under 300 ms).

A run on a fresh PostgreSQL database gets 100,001 metric rows: the 11 metric keys the run page charts
(every stored row belongs to a charted series, the page's worst case) x 9,091 steps, written through the
metrics service's ingest (the path worker batches take), 100 steps per batch. It also gets 200 events,
two host processes and a placement decision, and is left RUNNING, so every part of the page is live.

Then one API process (`locojax serve`, a single uvicorn worker, the dashboard plugin loaded) answers a
logged-in session: after a warm-up, each page or partial is requested 50 times in a row over one
keep-alive connection and timed at the client on loopback (an upper bound of server time; loopback
HTTP adds well under a millisecond). The run page renders everything, charts' data included.

Writes bench/results/dashboard.json; the last line printed is `run_page_p95_ms=<x>`.

    .venv/bin/python bench/dashboard.py [--pg-url postgresql://postgres@127.0.0.1:5432/postgres] [--requests 50]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

# Sibling benchmark: the same throwaway-database and server-process helpers.
from metrics_ingest import fresh_database, running

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from locojax.spec import parse_spec  # noqa: E402
from server.db import Database, upgrade_to_head  # noqa: E402
from server.models import AGGREGATE_HOST, HostProcessStatus, HostRole, RunStatus, StepMetric  # noqa: E402
from server.schemas import EventCreate, MetricsBatch, PlacementRecommendRequest, RunHostUpsert  # noqa: E402
from server.services import events as event_service  # noqa: E402
from server.services import host_reports  # noqa: E402
from server.services import metrics as metric_service  # noqa: E402
from server.services import placement as placement_service  # noqa: E402
from server.services import runs as run_service  # noqa: E402
from server.services import tokens as token_service  # noqa: E402
from server.settings import Settings  # noqa: E402
from web.charts import RUN_CHART_KEYS  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "dashboard.json"
TARGET_ROWS = 100_000
BATCH_STEPS = 100


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def value(key_index: int, step: int) -> float:
    return math.sin(step * 0.002 + key_index) + 0.1 * ((step * 7919 + key_index) % 13) + key_index


def populate(database_url: str, work: Path) -> tuple[int, str, dict]:
    """The run, its rows and its surroundings, written through the services. Returns (run id, token, facts)."""
    settings = Settings(home=work / ".locojax", database_url=database_url, broker_url="memory://",
                        migrate_on_start=False, scheduler_enabled=False, runs_root=work / "runs", data_roots=[work])
    upgrade_to_head(settings.database_url)
    db = Database(settings)
    steps = math.ceil(TARGET_ROWS / len(RUN_CHART_KEYS))
    try:
        with db.write_session() as session:
            _, token = token_service.create(session, name="dashboard-bench", scopes=["submit"])
            decision = placement_service.recommend(session, PlacementRecommendRequest(
                model="qwen3-0.6b", hardware="tpu-v5e", chips=8, workload="gsm8k"), created_by="bench")
            spec = parse_spec({"name": "dashboard-bench", "steps": steps,
                               "placement": {"mode": "co", "hosts": 2, "decision_id": decision.id}})
            run, _ = run_service.create(session, spec, settings, created_by="bench", owner_token_id=None)
            run_id = run.id
        with db.write_session() as session:
            for to in (RunStatus.STARTING, RunStatus.RUNNING):
                run_service.report_transition(session, run_id, to, reason=None, expected=None, source="bench")
        for index in range(2):
            with db.write_session() as session:
                host_reports.upsert_host_process(session, run_id, index, RunHostUpsert(
                    host_name=f"bench-host-{index}", role=HostRole.CO, status=HostProcessStatus.RUNNING,
                    pid=1000 + index))

        start = time.perf_counter()
        for first in range(0, steps, BATCH_STEPS):
            rows = [{"step": step, "host": AGGREGATE_HOST,
                     "values": {key: value(index, step) for index, key in enumerate(RUN_CHART_KEYS)}}
                    for step in range(first, min(first + BATCH_STEPS, steps))]
            with db.write_session() as session:
                metric_service.ingest(session, run_id, MetricsBatch.model_validate({"rows": rows, "attempt": 0}),
                                      max_values=settings.metrics_batch_max_values)
        ingest_s = time.perf_counter() - start
        with db.write_session() as session:
            event_service.append(session, run_id, [EventCreate(message=f"step {step}: reward {value(0, step):.3f}",
                                                               seq=step) for step in range(200)], source="bench")
        with db.read_session() as session:
            stored = session.scalar(select(func.count()).select_from(StepMetric).where(StepMetric.run_id == run_id))
    finally:
        db.dispose()
    return run_id, token, {"metric_rows": stored, "metric_keys": len(RUN_CHART_KEYS), "steps": steps,
                           "ingest_s": round(ingest_s, 2), "events": 200, "host_processes": 2}


def login(client: httpx.Client, token: str) -> None:
    page = client.get("/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    response = client.post("/login", data={"token": token, "csrf_token": csrf, "next": "/runs"})
    if response.status_code != 303:
        raise RuntimeError(f"login failed: {response.status_code} {response.text[:300]}")


def timed(client: httpx.Client, path: str, repeats: int, headers: dict[str, str] | None = None) -> dict:
    for _ in range(5):  # warm the connection, the template cache and the database's buffers
        client.get(path, headers=headers).raise_for_status()
    samples, size = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        response = client.get(path, headers=headers)
        samples.append((time.perf_counter() - start) * 1000)
        response.raise_for_status()
        size = len(response.content)
    samples.sort()
    return {"p50_ms": round(statistics.median(samples), 2),
            "p95_ms": round(samples[max(0, math.ceil(0.95 * len(samples)) - 1)], 2),
            "max_ms": round(samples[-1], 2), "requests": repeats, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dashboard-bench-") as tmp, \
            fresh_database(args.pg_url, "locojax_dashboard_bench") as database_url:
        work = Path(tmp)
        run_id, token, facts = populate(database_url, work)
        print(f"stored {facts['metric_rows']:,} metric rows ({facts['metric_keys']} keys x {facts['steps']:,} steps) "
              f"in {facts['ingest_s']} s", flush=True)
        env = {**os.environ, "LOCOJAX_DATABASE_URL": database_url, "LOCOJAX_BROKER_URL": "memory://",
               "LOCOJAX_LOG_LEVEL": "warning", "LOCOJAX_HOME": str(work / ".locojax"),
               "LOCOJAX_SCHEDULER_ENABLED": "false", "LOCOJAX_RUNS_ROOT": str(work / "runs")}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "locojax.cli", "serve", "--port", str(port)]
        htmx = {"HX-Request": "true"}
        with running(command, env, f"{url}/healthz", work / "server.log"), \
                httpx.Client(base_url=url, timeout=60, follow_redirects=False) as client:
            login(client, token)
            endpoints = {
                "run_page": (f"/runs/{run_id}", None),
                "charts_json": (f"/runs/{run_id}/charts.json", None),
                "header_partial": (f"/runs/{run_id}/header", htmx),
                "latest_partial": (f"/runs/{run_id}/latest", htmx),
                "hosts_partial": (f"/runs/{run_id}/processes", htmx),
                "decision_partial": (f"/runs/{run_id}/decision", htmx),
                "status_badge": (f"/runs/{run_id}/status", htmx),
                "runs_list": ("/runs", None),
            }
            results = {name: timed(client, path, args.requests, headers) for name, (path, headers) in endpoints.items()}

    run_page_p95 = results["run_page"]["p95_ms"]
    result = {
        "benchmark": "dashboard",
        "description": "client-timed GETs on loopback against one `locojax serve` process (PostgreSQL), "
                       "for a RUNNING run with ~100k metric rows, all in charted series",
        "data": facts,
        "endpoints": results,
        "run_page_p95_ms": run_page_p95,
        "target_ms": 300,
        # The machine is shared; the load during the measurement says how much of it this run had.
        "machine": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
                    "python": platform.python_version(), "platform": platform.platform()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'endpoint':<20}{'p50 ms':>10}{'p95 ms':>10}{'max ms':>10}{'bytes':>10}")
    for name, stats in results.items():
        print(f"{name:<20}{stats['p50_ms']:>10}{stats['p95_ms']:>10}{stats['max_ms']:>10}{stats['bytes']:>10,}")
    print(f"run_page_p95_ms={run_page_p95}")


if __name__ == "__main__":
    main()
