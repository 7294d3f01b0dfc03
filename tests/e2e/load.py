"""Load: `clients` concurrent clients on loopback for `duration_s`, while a run trains, mixing what users
and workers send: run submissions (each cancelled by its client right after), run lists and gets, metric
ingestion (a worker's batches) and history and summary queries.

Bounded in time and count: every client stops issuing requests at the deadline and each request has a
timeout, so the scenario ends by itself. Latency is measured at the client (one asyncio loop in this
process, so it includes the client's own queueing on a shared machine: an upper bound of server time).
Afterwards: every submitted run is in the database (CANCELLED), every ingested value is stored once, and
the training run's metrics are complete.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import statistics
import time
from typing import Any

import httpx

from tests.e2e.faults import wait_training
from tests.e2e.helpers import last_step, placed_sink, tiny_spec, wait_final
from tests.e2e.infra import Stack
from tests.e2e.outcome import audit_run, outcome

# (kind, weight): what a client does next.
MIX = [("submit", 1), ("list", 2), ("get", 3), ("ingest", 2), ("history", 2), ("summary", 1)]
KEYS = ["load/a", "load/b", "load/c", "load/d", "load/e"]
STEPS_PER_BATCH = 10


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _drive(stack: Stack, *, clients: int, duration_s: float, train_id: int, sink_id: int,
                 prefix: str, tokens: dict[str, str]) -> dict[str, Any]:
    latencies: dict[str, list[float]] = {kind: [] for kind, _ in MIX}
    errors: list[str] = []
    submitted: list[int] = []
    ingested = 0
    sent = 0
    kinds, weights = zip(*MIX)
    submit = {"Authorization": f"Bearer {tokens['submit']}"}
    worker = {"Authorization": f"Bearer {tokens['worker']}"}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    deadline = time.monotonic() + duration_s

    async with httpx.AsyncClient(base_url=stack.url, timeout=60.0, limits=limits) as http:
        async def request(kind: str, method: str, url: str, expect: int, **kwargs: Any) -> httpx.Response | None:
            nonlocal sent
            sent += 1
            started = time.perf_counter()
            try:
                response = await http.request(method, url, **kwargs)
            except httpx.HTTPError as exc:
                errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                return None
            latencies[kind].append(time.perf_counter() - started)
            if response.status_code != expect:
                errors.append(f"{kind}: {response.status_code} {response.text[:200]}")
                return None
            return response

        async def client(index: int) -> None:
            nonlocal ingested
            rng = random.Random(index)
            batches = 0
            while time.monotonic() < deadline:
                kind = rng.choices(kinds, weights)[0]
                if kind == "submit":
                    # Needs all three hosts while the training run holds one: it queues, and is cancelled.
                    spec = tiny_spec(f"{prefix}-{index}-{batches}-{rng.randrange(10**6)}", hosts=3, steps=1,
                                     rollout={"prompts_per_step": 3, "group_size": 2, "max_prompt_tokens": 48,
                                              "max_new_tokens": 6})
                    response = await request(kind, "POST", "/api/v1/runs", 201, json={"spec": spec}, headers=submit)
                    if response is not None:
                        run_id = response.json()["id"]
                        submitted.append(run_id)
                        await request(kind, "POST", f"/api/v1/runs/{run_id}/cancel", 202, headers=submit)
                    batches += 1
                elif kind == "list":
                    await request(kind, "GET", "/api/v1/runs", 200, params={"limit": 20}, headers=submit)
                elif kind == "get":
                    run_id = rng.choice(submitted) if submitted and rng.random() < 0.5 else train_id
                    await request(kind, "GET", f"/api/v1/runs/{run_id}", 200, headers=submit)
                elif kind == "ingest":
                    first = batches * STEPS_PER_BATCH
                    rows = [{"step": step, "host": index, "values": {key: rng.random() for key in KEYS}}
                            for step in range(first, first + STEPS_PER_BATCH)]
                    if await request(kind, "POST", f"/api/v1/runs/{sink_id}/metrics", 200,
                                     json={"rows": rows, "attempt": 0},
                                     headers=worker) is not None:
                        ingested += len(rows) * len(KEYS)
                    batches += 1
                elif kind == "history":
                    run_id, keys, host = ((train_id, ["time/step", "reward/mean"], -1) if rng.random() < 0.5
                                          else (sink_id, KEYS[:2], index))
                    await request(kind, "GET", f"/api/v1/runs/{run_id}/metrics/history", 200, headers=submit,
                                  params={"key": keys, "host": host, "max_points": 200})
                else:
                    await request(kind, "GET", f"/api/v1/runs/{train_id}/metrics/summary", 200, headers=submit)

        started = time.monotonic()
        await asyncio.gather(*(client(index) for index in range(clients)))
        elapsed = time.monotonic() - started
    every = [value for values in latencies.values() for value in values]
    return {
        "requests": sent,
        "errors": len(errors), "error_sample": errors[:10], "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(every) / elapsed, 1) if elapsed else None,
        "p50_ms": round(1000 * _percentile(every, 0.50), 1) if every else None,
        "p99_ms": round(1000 * _percentile(every, 0.99), 1) if every else None,
        "max_ms": round(1000 * max(every), 1) if every else None,
        "per_kind": {kind: {"requests": len(values),
                            "p50_ms": round(1000 * statistics.median(values), 1) if values else None,
                            "p99_ms": round(1000 * _percentile(values, 0.99), 1) if values else None}
                     for kind, values in latencies.items()},
        "submitted": submitted, "values_ingested": ingested,
    }


def load(stack: Stack, *, clients: int = 50, duration_s: float = 60.0) -> dict[str, Any]:
    prefix = f"load{secrets.token_hex(2)}"
    tokens = {"submit": stack.plane.admin_token, "worker": stack.plane.worker_token}
    with stack.client() as api:
        with stack.http() as http:
            admin = {"Authorization": f"Bearer {stack.plane.admin_token}"}
            made = http.post("/api/v1/tokens", json={"name": f"{prefix}-submit", "scopes": ["submit"]}, headers=admin)
            tokens["submit"] = made.json()["token"]
        train = api.submit(tiny_spec(f"{prefix}-train", hosts=1, steps=100_000, every=0))
        sink = placed_sink(stack, api, f"{prefix}-sink")  # never starts; takes the load's metrics
        wait_training(api, train["id"], step=1)
        step_before = last_step(api, train["id"])
        result = asyncio.run(_drive(stack, clients=clients, duration_s=duration_s, train_id=train["id"],
                                    sink_id=sink["id"], prefix=prefix, tokens=tokens))
        step_after = last_step(api, train["id"])
        api.cancel_run(sink["id"])
        api.cancel_run(train["id"])
        final = wait_final(api, train["id"], 120)
        trained = api.get_run(train["id"])
        audit = audit_run(stack, api, train["id"], hosts=1, steps=last_step(api, train["id"]) + 1)
    submitted = result.pop("submitted")
    rows = stack.sql("SELECT status, count(*) FROM runs WHERE name LIKE :prefix GROUP BY status",
                     prefix=f"{prefix}-%-%-%")
    by_status = {str(status.value if hasattr(status, "value") else status): count for status, count in rows}
    stored = stack.sql("SELECT count(*) FROM step_metrics WHERE run_id = :run_id", run_id=sink["id"])[0][0]
    return outcome({
        "no request failed": result["errors"] == 0,
        "every submitted run is stored, and CANCELLED": by_status == ({"CANCELLED": len(submitted)}
                                                                      if submitted else {}),
        "every ingested value is stored once": stored == result["values_ingested"],
        "the run trained during the load": step_after > step_before,
        "the training run was cancelled cleanly": final["status"] == "CANCELLED",
    }, audits=[audit], clients=clients, duration_s=duration_s, **result, runs_submitted=len(submitted),
        runs_by_status=by_status, values_stored=stored, steps_trained_during_load=step_after - step_before,
        training_restarts=trained["restarts"])
