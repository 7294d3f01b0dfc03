"""Metric ingest (idempotent, all or nothing) and the history/summary queries."""

from __future__ import annotations

import math
import random

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from server.app import create_app
from server.models import RunStatus, StepMetric
from tests.server.helpers import assert_error, insert_run


def _rows(db) -> list[tuple]:
    with db.read_session() as session:
        return session.execute(select(StepMetric.key, StepMetric.host, StepMetric.step, StepMetric.value)
                               .order_by(StepMetric.key, StepMetric.host, StepMetric.step)).all()


def _post(client, headers, run_id, rows):
    return client.post(f"/api/v1/runs/{run_id}/metrics", json={"rows": rows, "attempt": 0}, headers=headers)


def test_ingest_and_retry_are_idempotent(client, db, worker):
    run_id = insert_run(db, RunStatus.RUNNING, placed_on="h0")
    rows = [{"step": s, "host": h, "values": {"loss/policy": s * 0.5 + h, "reward/mean": 1.0}}
            for s in range(3) for h in (-1, 0, 1)]
    response = _post(client, worker, run_id, rows)
    assert response.status_code == 200 and response.json() == {"run_id": run_id, "values": 18}
    assert _post(client, worker, run_id, rows).json()["values"] == 18  # a retried batch
    stored = _rows(db)
    assert len(stored) == 18
    assert ("loss/policy", 1, 2, 2.0) in stored
    # a later correction of the same (run, step, host, key) overwrites
    _post(client, worker, run_id, [{"step": 2, "host": 1, "values": {"loss/policy": -7.0}}])
    assert ("loss/policy", 1, 2, -7.0) in _rows(db) and len(_rows(db)) == 18


def test_repeats_inside_one_batch_keep_the_last_value(client, db, worker):
    run_id = insert_run(db, placed_on="h0")
    rows = [{"step": 1, "values": {"a": 1.0}}, {"step": 1, "values": {"a": 2.0}}]
    assert _post(client, worker, run_id, rows).json()["values"] == 1
    assert _rows(db) == [("a", -1, 1, 2.0)]


def _deliveries(client, headers, run_id) -> dict[tuple[str, int], tuple[int, int]]:
    response = client.get(f"/api/v1/runs/{run_id}/metrics/deliveries", headers=headers)
    assert response.status_code == 200, response.text
    return {(s["key"], s["host"]): (s["values_posted"], s["values_stored"]) for s in response.json()["series"]}


def test_duplicates_the_upsert_collapses_stay_countable(client, db, worker, submitter):
    """Rows stored cannot show a duplicate (the primary key collapses it); the delivery count can."""
    run_id = insert_run(db, RunStatus.RUNNING, placed_on="h0")
    rows = [{"step": s, "host": h, "values": {"a": float(s), "b": 1.0}} for s in range(4) for h in (-1, 0)]
    _post(client, worker, run_id, rows)
    assert _deliveries(client, submitter, run_id) == {(k, h): (4, 4) for k in "ab" for h in (-1, 0)}  # once each
    _post(client, worker, run_id, rows[:3])  # a retried part of the batch: steps 0-1 of host -1, step 0 of host 0
    _post(client, worker, run_id, [{"step": 9, "values": {"a": 1.0}}, {"step": 9, "values": {"a": 2.0}}])
    counts = _deliveries(client, submitter, run_id)
    assert counts[("a", -1)] == (4 + 2 + 2, 5) and counts[("b", -1)] == (4 + 2, 4)
    assert counts[("a", 0)] == (5, 4) and counts[("b", 0)] == (5, 4)
    assert len(_rows(db)) == 17  # what a row count sees: no trace of the 7 repeated values
    assert_error(client.get("/api/v1/runs/4242/metrics/deliveries", headers=submitter), 404, "RUN_NOT_FOUND")


def test_metrics_for_a_finished_run_are_refused(client, db, worker):
    # A worker delivers every metric before the exit report that can end the run; anything later is a
    # stale relay (issue 17), refused so that it stops.
    run_id = insert_run(db, RunStatus.SUCCEEDED, placed_on="h0")
    assert_error(_post(client, worker, run_id, [{"step": 9, "values": {"a": 1.0}}]), 409, "RUN_FINISHED")


@pytest.mark.parametrize("bad_row", [
    {"step": -1, "values": {"a": 1.0}},
    {"step": 1, "host": -2, "values": {"a": 1.0}},
    {"step": 1, "values": {}},
    {"step": 1, "values": {"a": "high"}},
    {"step": 1, "values": {"a": None}},
    {"step": 1, "values": {"bad key!": 1.0}},
    {"step": 1, "values": {"k" * 201: 1.0}},
    {"step": 2**31, "values": {"a": 1.0}},
    {"step": 1, "values": {"a": 1.0}, "extra": True},
    {"values": {"a": 1.0}},
])
def test_one_bad_row_rejects_the_whole_batch(client, db, worker, bad_row):
    run_id = insert_run(db, placed_on="h0")
    good = [{"step": s, "values": {"a": float(s)}} for s in range(50)]
    error = assert_error(_post(client, worker, run_id, good + [bad_row] + good), 422, "VALIDATION_ERROR")
    assert error["details"][0]["field"].startswith("rows.50")  # names the offending row
    assert _rows(db) == []


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_values_are_rejected(client, db, worker, literal):
    run_id = insert_run(db, placed_on="h0")
    body = b'{"rows": [{"step": 1, "values": {"ok": 1.0}}, {"step": 2, "values": {"bad": ' + literal + b"}}]}"
    response = client.post(f"/api/v1/runs/{run_id}/metrics", content=body,
                           headers={**worker, "content-type": "application/json"})
    assert_error(response, 422)
    assert _rows(db) == []


def test_oversize_batches_are_413(db, worker, backend):
    small = create_app(backend.settings.model_copy(update={"metrics_batch_max_values": 100}), plugins=False)
    try:
        run_id = insert_run(db, placed_on="h0")
        rows = [{"step": s, "values": {f"k{i}": 1.0 for i in range(10)}} for s in range(11)]
        error = assert_error(_post(TestClient(small), worker, run_id, rows), 413, "BATCH_TOO_LARGE")
        assert error["details"] == {"values": 110, "limit": 100}
        assert _rows(db) == []
    finally:
        small.state.db.dispose()


def test_unknown_run_is_404_and_empty_batch_is_422(client, worker):
    assert_error(_post(client, worker, 424242, [{"step": 0, "values": {"a": 1.0}}]), 404, "RUN_NOT_FOUND")
    assert_error(_post(client, worker, 424242, []), 422)


def _reference_buckets(points: dict[int, float], width: int):
    """min/max/last per bucket `step // width`, straight from the raw points."""
    buckets: dict[int, list[int]] = {}
    for step in sorted(points):
        buckets.setdefault(step // width, []).append(step)
    return [(steps[-1], points[steps[-1]], min(points[s] for s in steps), max(points[s] for s in steps))
            for _, steps in sorted(buckets.items())]


def _history(client, headers, run_id, **params):
    response = client.get(f"/api/v1/runs/{run_id}/metrics/history", params=params, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["series"]


# (steps, max_points, stride): raw points, raw buckets, level-16 and level-256 rollups, gaps in steps.
@pytest.mark.parametrize(("n_steps", "max_points", "stride"),
                         [(300, 1000, 1), (1000, 200, 1), (1000, 7, 1), (999, 10, 3), (5, 2, 100), (5000, 1000, 1)])
def test_history_downsampling_matches_a_reference(client, db, worker, n_steps, max_points, stride):
    rng = random.Random(n_steps + max_points)
    run_id = insert_run(db, placed_on="h0")
    points = {s * stride + 3: rng.uniform(-5, 5) for s in range(n_steps)}
    rows = [{"step": step, "values": {"reward/mean": value}} for step, value in points.items()]
    for start in range(0, len(rows), 700):  # batches that straddle rollup buckets
        _post(client, worker, run_id, rows[start:start + 700])
    (series,) = _history(client, worker, run_id, key="reward/mean", max_points=max_points)
    width = series["bucket_steps"]
    span = max(points) - min(points) + 1
    assert len(series["steps"]) <= max_points
    base = math.ceil(span / max_points)
    assert width == 1 if span <= max_points else base <= width < 2 * base + 256  # never much coarser than asked
    assert series["steps"][-1] == max(points)  # the newest step is always there
    got = list(zip(series["steps"], series["last"], series["min"], series["max"]))
    assert got == _reference_buckets(points, width)  # doubles survive the database and JSON exactly


def test_rollups_follow_corrections_both_ways(client, db, worker):
    run_id = insert_run(db, placed_on="h0")
    _post(client, worker, run_id, [{"step": s, "values": {"loss/kl": 1.0}} for s in range(4096)])
    (series,) = _history(client, worker, run_id, key="loss/kl", max_points=16)
    assert series["bucket_steps"] == 256 and set(series["min"]) == {1.0}
    _post(client, worker, run_id, [{"step": 300, "values": {"loss/kl": -9.0}}, {"step": 4095, "values": {"loss/kl": 7.0}}])
    (series,) = _history(client, worker, run_id, key="loss/kl", max_points=16)
    assert series["min"][1] == -9.0 and series["last"][-1] == 7.0 and series["max"][-1] == 7.0
    _post(client, worker, run_id, [{"step": 300, "values": {"loss/kl": 1.0}}])  # the correction is undone
    (series,) = _history(client, worker, run_id, key="loss/kl", max_points=16)
    assert series["min"][1] == 1.0


@pytest.mark.parametrize(("start", "end"), [(256, 2303), (100, 3000), (0, None), (None, 1000)])
def test_history_windows_aligned_or_not_are_exact(client, db, worker, start, end):
    rng = random.Random(7)
    run_id = insert_run(db, placed_on="h0")
    points = {s: rng.uniform(0, 1) for s in range(4000)}
    _post(client, worker, run_id, [{"step": s, "values": {"a": v}} for s, v in points.items()])
    window = {s: v for s, v in points.items() if (start is None or s >= start) and (end is None or s <= end)}
    params = {"key": "a", "max_points": 7, **({"start_step": start} if start is not None else {}),
              **({"end_step": end} if end is not None else {})}
    (series,) = _history(client, worker, run_id, **params)
    got = list(zip(series["steps"], series["last"], series["min"], series["max"]))
    assert got == _reference_buckets(window, series["bucket_steps"]) and len(got) <= 7


def test_history_for_several_keys_and_hosts_and_a_step_window(client, db, worker):
    run_id = insert_run(db, placed_on="h0")
    rows = [{"step": s, "host": h, "values": {"time/step": 1.0 + h, "loss/kl": -s}} for s in range(100) for h in (-1, 0, 1)]
    _post(client, worker, run_id, rows)
    params = [("key", "time/step"), ("key", "loss/kl"), ("key", "missing"), ("host", "0"), ("host", "1"),
              ("max_points", "10"), ("start_step", "50"), ("end_step", "79")]
    series = client.get(f"/api/v1/runs/{run_id}/metrics/history", params=params, headers=worker).json()["series"]
    assert [(s["key"], s["host"]) for s in series] == [("time/step", 0), ("time/step", 1), ("loss/kl", 0), ("loss/kl", 1),
                                                       ("missing", 0), ("missing", 1)]
    kl = series[2]
    assert kl["bucket_steps"] == 4 and kl["steps"] == [51, 55, 59, 63, 67, 71, 75, 79]  # buckets step // 4
    assert (kl["min"][1], kl["max"][1], kl["last"][1]) == (-55, -52, -55)
    assert series[4]["steps"] == []


@pytest.mark.parametrize("params", [{}, {"key": "a", "max_points": 1}, {"key": "a", "host": -2}, {"key": "bad key"}])
def test_bad_history_queries_are_422(client, db, worker, params):
    run_id = insert_run(db, placed_on="h0")
    assert_error(client.get(f"/api/v1/runs/{run_id}/metrics/history", params=params, headers=worker), 422)


def test_too_many_series_is_422(client, db, worker):
    run_id = insert_run(db, placed_on="h0")
    params = [("key", f"k{i}") for i in range(33)] + [("host", "0"), ("host", "1")]
    error = assert_error(client.get(f"/api/v1/runs/{run_id}/metrics/history", params=params, headers=worker), 422)
    assert "series" in error["message"]


def test_max_points_is_clamped_to_the_server_maximum(client, db, worker, backend):
    run_id = insert_run(db, placed_on="h0")
    history = client.get(f"/api/v1/runs/{run_id}/metrics/history", params={"key": "a", "max_points": 10**9},
                         headers=worker).json()
    assert history["max_points"] == backend.settings.history_max_points


def test_summary_and_keys(client, db, worker):
    run_id = insert_run(db, placed_on="h0")
    _post(client, worker, run_id, [{"step": s, "host": h, "values": {"reward/mean": s / 10, "time/step": 2.0}}
                                   for s in range(5) for h in (-1, 0)])
    _post(client, worker, run_id, [{"step": 7, "values": {"reward/mean": 0.9}}])  # aggregated only
    summary = client.get(f"/api/v1/runs/{run_id}/metrics/summary", headers=worker).json()
    assert summary["last_step"] == 7
    assert summary["values"] == {"reward/mean": {"step": 7, "value": 0.9}, "time/step": {"step": 4, "value": 2.0}}
    host0 = client.get(f"/api/v1/runs/{run_id}/metrics/summary", params={"host": 0}, headers=worker).json()
    assert host0["values"]["reward/mean"] == {"step": 4, "value": 0.4}
    keys = client.get(f"/api/v1/runs/{run_id}/metrics/keys", headers=worker).json()
    assert (keys["keys"], keys["hosts"]) == (["reward/mean", "time/step"], [-1, 0])
    # an older step arriving late does not replace the latest; a correction of the latest does
    _post(client, worker, run_id, [{"step": 3, "values": {"reward/mean": -1.0}}])
    _post(client, worker, run_id, [{"step": 7, "values": {"reward/mean": 0.95}}])
    latest = client.get(f"/api/v1/runs/{run_id}/metrics/summary", headers=worker).json()["values"]["reward/mean"]
    assert latest == {"step": 7, "value": 0.95}
    empty = client.get(f"/api/v1/runs/{insert_run(db, placed_on='h0')}/metrics/summary", headers=worker).json()
    assert (empty["last_step"], empty["values"]) == (None, {})


def test_metric_reads_of_unknown_runs_are_404(client, worker):
    for path in ("history?key=a", "summary", "keys"):
        assert_error(client.get(f"/api/v1/runs/5555/metrics/{path}", headers=worker), 404, "RUN_NOT_FOUND")


def test_deleting_a_run_deletes_its_metrics(client, db, worker, admin):
    keep, drop = insert_run(db, RunStatus.RUNNING, placed_on="h0"), insert_run(db, RunStatus.RUNNING, placed_on="h0")
    for run_id in (keep, drop):
        assert _post(client, worker, run_id, [{"step": 0, "values": {"a": 1.0}}]).status_code == 200
        client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": "FAILED"}, headers=admin)
    assert client.delete(f"/api/v1/runs/{drop}", headers=admin).status_code == 204
    with db.read_session() as session:
        assert session.scalar(select(func.count()).select_from(StepMetric)) == 1


def test_bucket_plan_properties():
    from server.models import ROLLUP_LEVELS
    from server.services.metrics import bucket_plan

    rng = random.Random(11)
    for _ in range(3000):
        lo = rng.randrange(0, 10**6)
        hi = lo + rng.randrange(0, 10**7)
        max_points = rng.randrange(2, 5000)
        start = rng.choice([None, lo, lo - lo % 32])
        width, level = bucket_plan(lo, hi, max_points, start_step=start)
        base = math.ceil((hi - lo + 1) / max_points)
        assert hi // width - lo // width + 1 <= max_points
        assert width % level == 0 and (level == 1 or level in ROLLUP_LEVELS) and level <= base
        assert width < 2 * base + level  # never much coarser than asked
        assert start is None or level == 1 or start % level == 0  # rollups never straddle the window edge


def test_random_retries_corrections_and_late_rows_keep_every_query_exact(client, db, worker):
    rng = random.Random(5)
    run_id = insert_run(db, placed_on="h0")
    truth: dict[tuple[str, int], dict[int, float]] = {}
    sent: list[list[dict]] = []
    for _ in range(25):
        if sent and rng.random() < 0.3:
            batch = rng.choice(sent)  # a retry of an earlier batch, byte for byte
        else:
            start = rng.randrange(0, 3000)
            batch = [{"step": s, "host": h, "values": {k: round(rng.uniform(-10, 10), 3) for k in ("a", "b")}}
                     for s in range(start, start + rng.randrange(1, 200), rng.choice([1, 1, 3])) for h in (-1, 0)]
            sent.append(batch)
        # Retried batches re-assert old values: replay them into the truth too, in order.
        for row in batch:
            for key, value in row["values"].items():
                truth.setdefault((key, row["host"]), {})[row["step"]] = value
        assert _post(client, worker, run_id, batch).status_code == 200
    for max_points in (3, 17, 100, 5000):
        params = [("key", "a"), ("key", "b"), ("host", "-1"), ("host", "0"), ("max_points", str(max_points))]
        response = client.get(f"/api/v1/runs/{run_id}/metrics/history", params=params, headers=worker)
        for series in response.json()["series"]:
            points = truth[(series["key"], series["host"])]
            got = list(zip(series["steps"], series["last"], series["min"], series["max"]))
            assert got == _reference_buckets(points, series["bucket_steps"]), (series["key"], series["host"], max_points)
    summary = client.get(f"/api/v1/runs/{run_id}/metrics/summary", params={"host": 0}, headers=worker).json()
    for key in ("a", "b"):
        last = max(truth[(key, 0)])
        assert summary["values"][key] == {"step": last, "value": truth[(key, 0)][last]}


def test_a_run_holds_at_most_a_thousand_distinct_metric_keys(client, db, worker):
    run_id = insert_run(db, RunStatus.RUNNING, placed_on="h0")
    first = {f"k/{i}": 1.0 for i in range(600)}
    assert _post(client, worker, run_id, [{"step": 0, "values": first}]).status_code == 200
    # Known keys at later steps are always fine; new keys only up to the limit.
    assert _post(client, worker, run_id, [{"step": 1, "values": first}]).status_code == 200
    more = {f"k/{i}": 1.0 for i in range(600, 1001)}  # 1,001 in all
    error = assert_error(_post(client, worker, run_id, [{"step": 2, "values": more}]), 422, "TOO_MANY_METRIC_KEYS")
    assert error["details"][0]["have"] == 600 and error["details"][0]["new"] == 401
    assert len({row[0] for row in _rows(db)}) == 600  # nothing of the refused batch was written
    fits = {f"k/{i}": 1.0 for i in range(600, 1000)}
    assert _post(client, worker, run_id, [{"step": 2, "values": fits}]).status_code == 200
