"""Metric ingest: the LoCoJAX control plane vs an MLflow tracking server, on the same PostgreSQL.

The same stream of per-step metrics (20 keys x 4 hosts x 5,000 steps = 400,000 values) is posted in
batches of the same size (12 steps = 960 values, under MLflow's 1,000-metric limit per log-batch) by
one keep-alive HTTP client, first to our API and then to MLflow, each server a single worker process
backed by its own fresh database on the local PostgreSQL. Request bodies are built before the clock
starts, so what is timed is the servers (HTTP, validation, database writes). Both stores are then
counted, so a server that drops rows cannot win.

Then the p95 latency of our downsampled history query, measured from the client:
  * `single_series`: one series of 100,000 steps, max_points=1,000 (1,000 points over 100k rows);
  * `twenty_keys`: the 20 keys of one host (20 x 5,000 = 100k rows), max_points=50 (1,000 points).
`history_p95_ms` is the larger of the two. MLflow's own history calls are timed for reference.

MLflow is installed by this script into its own ignored venv (bench/.peer-venvs/mlflow), pinned.
Writes bench/results/metrics_ingest.json; the last line printed is `ingest_ratio_vs_mlflow=<x>`.

    .venv/bin/python bench/metrics_ingest.py [--steps 5000] [--pg-url postgresql://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "metrics_ingest.json"
MLFLOW_VENV = ROOT / "bench" / ".peer-venvs" / "mlflow"
MLFLOW_VERSION = "3.17.2"
KEYS = [f"{group}/{name}" for group in ("time", "reward", "loss", "policy")
        for name in ("step", "rollout", "train", "mean", "std")]  # 20 metric names
LONG_KEY, LONG_STEPS = "bench/long_series", 100_000


# --- infrastructure ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_mlflow() -> Path:
    mlflow = MLFLOW_VENV / "bin" / "mlflow"
    python = MLFLOW_VENV / "bin" / "python"
    if python.exists():
        probe = subprocess.run([str(python), "-c", "import mlflow, psycopg; print(mlflow.__version__)"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == MLFLOW_VERSION:
            return mlflow
    print(f"installing mlflow=={MLFLOW_VERSION} into {MLFLOW_VENV} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(MLFLOW_VENV)], check=True)
    # SQLAlchemy 2.1 (which this MLflow pulls in) maps postgresql:// to psycopg 3.
    subprocess.run([str(MLFLOW_VENV / "bin" / "pip"), "install", "-q", f"mlflow=={MLFLOW_VERSION}", "psycopg[binary]"],
                   check=True)
    return mlflow


@contextlib.contextmanager
def fresh_database(admin_url: str, prefix: str) -> Iterator[str]:
    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(admin_url, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin_url, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _wait_http(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {url}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


@contextlib.contextmanager
def running(command: list[str], env: dict[str, str], health_url: str, log: Path, timeout_s: float = 120
            ) -> Iterator[subprocess.Popen]:
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=log.parent,
                                   start_new_session=True)
        try:
            _wait_http(health_url, process, timeout_s)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _locojax(args: list[str], env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, "-m", "locojax.cli", *args], env=env, capture_output=True, text=True,
                            cwd=ROOT)
    if result.returncode:
        raise RuntimeError(f"locojax {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout.strip()


# --- the stream -------------------------------------------------------------------------------------

def value(key_index: int, host: int, step: int) -> float:
    return math.sin(step * 0.003 + key_index) * (1 + 0.1 * host) + key_index


def step_batches(steps: int, hosts: int, batch_steps: int) -> Iterator[range]:
    for start in range(0, steps, batch_steps):
        yield range(start, min(start + batch_steps, steps))


def our_bodies(steps: int, hosts: int, batch_steps: int) -> list[bytes]:
    return [json.dumps({"rows": [{"step": s, "host": h, "values": {k: value(i, h, s) for i, k in enumerate(KEYS)}}
                                 for s in batch for h in range(hosts)], "attempt": 0}).encode()
            for batch in step_batches(steps, hosts, batch_steps)]


def mlflow_bodies(run_id: str, steps: int, hosts: int, batch_steps: int) -> list[bytes]:
    base_ms = 1_700_000_000_000
    return [json.dumps({"run_id": run_id, "metrics": [
        {"key": f"host{h}/{k}", "value": value(i, h, s), "timestamp": base_ms + s, "step": s}
        for s in batch for h in range(hosts) for i, k in enumerate(KEYS)]}).encode()
        for batch in step_batches(steps, hosts, batch_steps)]


def post_all(client: httpx.Client, path: str, bodies: list[bytes]) -> float:
    headers = {"content-type": "application/json"}
    start = time.perf_counter()
    for body in bodies:
        response = client.post(path, content=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"{path}: {response.status_code} {response.text[:300]}")
    return time.perf_counter() - start


def p95_ms(client: httpx.Client, path: str, params, repeats: int) -> dict[str, float]:
    for _ in range(5):  # warm caches and connections
        client.get(path, params=params).raise_for_status()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        response = client.get(path, params=params)
        samples.append((time.perf_counter() - start) * 1000)
        response.raise_for_status()
    samples.sort()
    return {"p50_ms": round(statistics.median(samples), 2),
            "p95_ms": round(samples[max(0, math.ceil(0.95 * len(samples)) - 1)], 2),
            "max_ms": round(samples[-1], 2), "samples": repeats}


# --- the two servers --------------------------------------------------------------------------------

def bench_ours(database_url: str, args: argparse.Namespace, work: Path) -> dict:
    env = {**os.environ, "LOCOJAX_DATABASE_URL": database_url, "LOCOJAX_BROKER_URL": "memory://",
           "LOCOJAX_LOG_LEVEL": "warning", "LOCOJAX_HOME": str(work / ".locojax")}
    _locojax(["db", "upgrade"], env)
    # An admin token: the run is never placed on a host (no scheduler here), and an admin reports for any
    # run through the same ingest path (the attempt and placement checks included).
    token = _locojax(["token", "create", "--scope", "admin", "--name", "bench"], env)
    port = _free_port()
    command = [sys.executable, "-m", "locojax.cli", "serve", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running(command, env, f"{url}/healthz", work / "locojax-server.log"), \
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
        run_id = client.post("/api/v1/runs", json={"spec": {"name": "ingest-bench", "steps": args.steps}}).json()["id"]
        bodies = our_bodies(args.steps, args.hosts, args.batch_steps)
        seconds = post_all(client, f"/api/v1/runs/{run_id}/metrics", bodies)
        rows = args.steps * args.hosts * len(KEYS)

        # Extra: the same stream once more in larger batches (what a worker batching 125 steps sends),
        # for information; idempotent, so the row count stays the same.
        big_bodies = our_bodies(args.steps, args.hosts, 125)
        big_seconds = post_all(client, f"/api/v1/runs/{run_id}/metrics", big_bodies)

        long_bodies = [json.dumps({"rows": [{"step": s, "host": -1, "values": {LONG_KEY: math.cos(s * 1e-3)}}
                                            for s in range(start, min(start + 5000, LONG_STEPS))],
                                   "attempt": 0}).encode()
                       for start in range(0, LONG_STEPS, 5000)]
        post_all(client, f"/api/v1/runs/{run_id}/metrics", long_bodies)

        with psycopg.connect(database_url.replace("+psycopg", "")) as connection:
            stored = connection.execute("SELECT count(*) FROM step_metrics WHERE run_id = %s AND key <> %s",
                                        (run_id, LONG_KEY)).fetchone()[0]
            connection.execute("ANALYZE step_metrics")
        history_path = f"/api/v1/runs/{run_id}/metrics/history"
        single = p95_ms(client, history_path, {"key": LONG_KEY, "max_points": 1000}, args.repeats)
        single_points = client.get(history_path, params={"key": LONG_KEY, "max_points": 1000}).json()["series"][0]
        twenty_params = [("key", k) for k in KEYS] + [("host", "0"), ("max_points", "50")]
        twenty = p95_ms(client, history_path, twenty_params, args.repeats)
        twenty_points = sum(len(s["steps"]) for s in client.get(history_path, params=twenty_params).json()["series"])
        dashboard_params = [("key", k) for k in KEYS[:6]] + [("host", "0"), ("max_points", "1000")]
        dashboard = p95_ms(client, history_path, dashboard_params, args.repeats)
        summary = p95_ms(client, f"/api/v1/runs/{run_id}/metrics/summary", {"host": 0}, args.repeats)
    return {
        "rows": rows, "rows_stored": stored, "requests": len(bodies), "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds), "rows_per_s_batches_of_125_steps": round(rows / big_seconds),
        "history": {
            "single_series": {**single, "rows_covered": LONG_STEPS, "points": len(single_points["steps"]),
                              "last_step_included": single_points["steps"][-1] == LONG_STEPS - 1},
            "twenty_keys": {**twenty, "rows_covered": args.steps * len(KEYS), "points": twenty_points},
            "six_keys_1000_points_each": dashboard,
            "summary_latest_per_key": summary,
        },
    }


def bench_mlflow(database_url: str, args: argparse.Namespace, work: Path) -> dict:
    mlflow = ensure_mlflow()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    backend = database_url.replace("postgresql+psycopg://", "postgresql://")
    command = [str(mlflow), "server", "--backend-store-uri", backend, "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1", "--artifacts-destination", str(work / "mlartifacts")]
    env = {**os.environ, "MLFLOW_LOGGING_LEVEL": "WARNING"}
    with running(command, env, f"{url}/health", work / "mlflow-server.log", timeout_s=300), \
            httpx.Client(base_url=url, timeout=120) as client:
        experiment = client.post("/api/2.0/mlflow/experiments/create", json={"name": "ingest-bench"}).json()
        run = client.post("/api/2.0/mlflow/runs/create",
                          json={"experiment_id": experiment["experiment_id"], "start_time": 1_700_000_000_000}).json()
        run_id = run["run"]["info"]["run_id"]
        bodies = mlflow_bodies(run_id, args.steps, args.hosts, args.batch_steps)
        seconds = post_all(client, "/api/2.0/mlflow/runs/log-batch", bodies)
        rows = args.steps * args.hosts * len(KEYS)
        with psycopg.connect(backend) as connection:
            stored = connection.execute("SELECT count(*) FROM metrics WHERE run_uuid = %s", (run_id,)).fetchone()[0]
        history = p95_ms(client, "/api/2.0/mlflow/metrics/get-history",
                         {"run_id": run_id, "metric_key": f"host0/{KEYS[0]}"}, max(10, args.repeats // 5))
    return {"rows": rows, "rows_stored": stored, "requests": len(bodies), "seconds": round(seconds, 3),
            "rows_per_s": round(rows / seconds), "version": MLFLOW_VERSION,
            "history_one_key_all_5000_points": history}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--batch-steps", type=int, default=12, help="steps per request (x hosts x 20 keys values)")
    parser.add_argument("--repeats", type=int, default=100, help="timed history queries per kind")
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="a PostgreSQL server where fresh databases may be created and dropped")
    parser.add_argument("--skip-mlflow", action="store_true")
    args = parser.parse_args()
    if args.batch_steps * args.hosts * len(KEYS) > 1000:
        parser.error("a batch must hold at most 1,000 values (MLflow's log-batch limit)")

    # Server logs and the throwaway state directory live outside the repository.
    work = Path(tempfile.mkdtemp(prefix="locojax-ingest-bench-"))
    with fresh_database(args.pg_url, "locojax_bench") as ours_url:
        ours = bench_ours(ours_url.replace("postgresql://", "postgresql+psycopg://"), args, work)
    print(f"locojax: {ours['rows_per_s']:>9,} rows/s  ({ours['rows_stored']:,} rows stored, "
          f"{ours['requests']} requests of {args.batch_steps * args.hosts * len(KEYS)} values)", flush=True)
    theirs = None
    if not args.skip_mlflow:
        with fresh_database(args.pg_url, "mlflow_bench") as mlflow_url:
            theirs = bench_mlflow(mlflow_url, args, work)
        print(f"mlflow:  {theirs['rows_per_s']:>9,} rows/s  ({theirs['rows_stored']:,} rows stored)", flush=True)

    history = ours["history"]
    history_p95 = max(history["single_series"]["p95_ms"], history["twenty_keys"]["p95_ms"])
    ratio = round(ours["rows_per_s"] / theirs["rows_per_s"], 2) if theirs else None
    result = {
        "benchmark": "metrics_ingest",
        "stream": {"keys": len(KEYS), "hosts": args.hosts, "steps": args.steps,
                   "values": args.steps * args.hosts * len(KEYS),
                   "values_per_request": args.batch_steps * args.hosts * len(KEYS)},
        "ingest_ratio_vs_mlflow": ratio,
        "history_p95_ms": history_p95,
        "targets": {"ingest_ratio_vs_mlflow": ">= 5", "history_p95_ms": "<= 50"},
        "locojax": ours,
        "mlflow": theirs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_1m": round(os.getloadavg()[0], 2)},
        "notes": "one keep-alive client, sequential requests; one server worker each; PostgreSQL backend for both",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    print()
    print(f"{'':<34}{'locojax':>12}{'mlflow':>12}")
    print(f"{'ingest rows/s':<34}{ours['rows_per_s']:>12,}{(theirs or {}).get('rows_per_s', float('nan')):>12,}")
    print(f"{'rows stored':<34}{ours['rows_stored']:>12,}{(theirs or {}).get('rows_stored', 0):>12,}")
    for name, stats in history.items():
        print(f"{'history ' + name + ' p95 ms':<34}{stats['p95_ms']:>12}")
    print(f"history_p95_ms={history_p95}")
    print(f"ingest_ratio_vs_mlflow={ratio}")


if __name__ == "__main__":
    main()
