"""Per-step metrics: batch ingest (idempotent upsert) and the queries charts need.

Ingest validates the whole batch first (pydantic, before this module sees it), then writes it in one
transaction: all or nothing. Rows are keyed (run, key, host, step); a retried batch overwrites the same
rows, so "every step's metrics exactly once" holds however often a worker retries. The same
transaction keeps the rollups (first step, min, max, last per aligned bucket of 4, 32 and 256 steps) of
every bucket the batch touched exact, corrections included, and the per-series row (step range, latest
value) behind the summary, the key list and query planning.

History downsampling happens in SQL. A series' steps [lo, hi] are cut into buckets `step // width`
(aligned to multiples of `width`), `width` being the smallest multiple of the chosen level that yields at
most `max_points` buckets; each bucket returns its min, its max and its last value (at its last step),
so the newest step is always present. When `width` spans whole rollup buckets the query reads the
rollups instead of the raw rows: the same answer from 4x to 256x fewer rows. Series that share a step
range (keys logged together) are answered by one statement; on PostgreSQL that statement walks the
series one by one (LATERAL), an index range scan each, whatever the planner's statistics say.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from psycopg.errors import UniqueViolation
from sqlalchemy import distinct, func, select, text, tuple_
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from server.errors import ApiError, InvalidInputError, NotFoundError
from server.models import ROLLUP_LEVELS, Run, StepMetric, StepMetricRollup, StepMetricSeries
from server.schemas import MetricSeries, MetricsBatch

Series = tuple[str, int]  # (key, host)
Bucket = tuple[int, float, float, float]  # (last step, last value, min, max)

# PostgreSQL writes a batch in two statements, the columns shipped as arrays (far fewer round trips and
# far less SQL text than multi-row VALUES):
#  1. the raw rows: a binary COPY first (no speculative insertion, no executor: about half the cost of
#     an INSERT), and only if a row already exists (a retried or corrected batch) the upsert below,
#     which reports the rows whose value it actually changed;
#  2. the rollups and the series rows, merged from aggregates of the batch computed here (min of mins,
#     max of maxes, the later last value): no raw row is read back. A merge is exact when the batch
#     only adds rows or repeats stored values; buckets holding a changed value are recomputed after.
_PG_BATCH = "unnest(CAST(:keys AS varchar[]), CAST(:hosts AS integer[]), CAST(:steps AS integer[]), " \
            "CAST(:vals AS double precision[])) AS t(k, h, s, v)"
_PG_COPY = "COPY step_metrics (run_id, key, host, step, value) FROM STDIN (FORMAT BINARY)"
_PG_COPY_TYPES = ["int4", "varchar", "int4", "int4", "float8"]
_PG_UPSERT = text(f"""
    WITH written AS (
        INSERT INTO step_metrics (run_id, key, host, step, value)
        SELECT :run_id, k, h, s, v FROM {_PG_BATCH}
        ON CONFLICT (run_id, key, host, step) DO UPDATE SET value = EXCLUDED.value
        WHERE step_metrics.value IS DISTINCT FROM EXCLUDED.value
        RETURNING key, host, step, xmax
    )
    SELECT key, host, step FROM written WHERE xmax <> 0  -- updated, not inserted (xmax is 0 on a fresh row)
""")
_PG_MERGE = text("""
    WITH rollups AS (
        INSERT INTO step_metric_rollups (run_id, key, host, level, bucket, first_step, low, high, last_step, last_value)
        SELECT :run_id, k, h, l, b, f, lo, hi, ls, lv
        FROM unnest(CAST(:r_keys AS varchar[]), CAST(:r_hosts AS integer[]), CAST(:r_levels AS integer[]),
                    CAST(:r_buckets AS integer[]), CAST(:r_firsts AS integer[]), CAST(:r_lows AS double precision[]),
                    CAST(:r_highs AS double precision[]), CAST(:r_lasts AS integer[]),
                    CAST(:r_values AS double precision[])) AS t(k, h, l, b, f, lo, hi, ls, lv)
        ON CONFLICT (run_id, key, host, level, bucket) DO UPDATE SET
            first_step = LEAST(step_metric_rollups.first_step, EXCLUDED.first_step),
            low = LEAST(step_metric_rollups.low, EXCLUDED.low),
            high = GREATEST(step_metric_rollups.high, EXCLUDED.high),
            last_value = CASE WHEN EXCLUDED.last_step >= step_metric_rollups.last_step
                              THEN EXCLUDED.last_value ELSE step_metric_rollups.last_value END,
            last_step = GREATEST(step_metric_rollups.last_step, EXCLUDED.last_step)
    )
    INSERT INTO step_metric_series (run_id, key, host, first_step, last_step, last_value, values_posted)
    SELECT :run_id, k, h, f, ls, lv, p
    FROM unnest(CAST(:s_keys AS varchar[]), CAST(:s_hosts AS integer[]), CAST(:s_firsts AS integer[]),
                CAST(:s_lasts AS integer[]), CAST(:s_values AS double precision[]),
                CAST(:s_posted AS bigint[])) AS t(k, h, f, ls, lv, p)
    ON CONFLICT (run_id, key, host) DO UPDATE SET
        values_posted = step_metric_series.values_posted + EXCLUDED.values_posted,
        first_step = LEAST(step_metric_series.first_step, EXCLUDED.first_step),
        last_value = CASE WHEN EXCLUDED.last_step >= step_metric_series.last_step
                          THEN EXCLUDED.last_value ELSE step_metric_series.last_value END,
        last_step = GREATEST(step_metric_series.last_step, EXCLUDED.last_step)
""")

_ROLLUP_COLUMNS = "run_id, key, host, level, bucket, first_step, low, high, last_step, last_value"
_UPSERT_ROLLUP = """
    ON CONFLICT (run_id, key, host, level, bucket) DO UPDATE SET first_step = excluded.first_step,
        low = excluded.low, high = excluded.high, last_step = excluded.last_step, last_value = excluded.last_value
"""
# PostgreSQL: every touched bucket of one level in one statement, from the level below (raw rows for
# the first level). The aggregate is a LATERAL subquery so it runs once per touched bucket as an index
# range scan: as a plain join, a planner with stale statistics (a run whose rows just grew) hashes the
# run's whole series instead. `(array_agg(v ORDER BY s DESC))[1]` is the value at the last step.
_PG_REFRESH = {
    "raw": text(f"""
        INSERT INTO step_metric_rollups ({_ROLLUP_COLUMNS})
        SELECT :run_id, t.k, t.h, :level, t.b, a.first_step, a.low, a.high, a.last_step, a.last_value
        FROM unnest(CAST(:keys AS varchar[]), CAST(:hosts AS integer[]), CAST(:buckets AS integer[])) AS t(k, h, b)
        CROSS JOIN LATERAL (
            SELECT min(m.step) AS first_step, min(m.value) AS low, max(m.value) AS high, max(m.step) AS last_step,
                   (array_agg(m.value ORDER BY m.step DESC))[1] AS last_value
            FROM step_metrics m
            WHERE m.run_id = :run_id AND m.key = t.k AND m.host = t.h
              AND m.step >= t.b * :level AND m.step < (t.b + 1) * :level) AS a
        WHERE a.last_step IS NOT NULL
        {_UPSERT_ROLLUP}"""),
    "rollup": text(f"""
        INSERT INTO step_metric_rollups ({_ROLLUP_COLUMNS})
        SELECT :run_id, t.k, t.h, :level, t.b, a.first_step, a.low, a.high, a.last_step, a.last_value
        FROM unnest(CAST(:keys AS varchar[]), CAST(:hosts AS integer[]), CAST(:buckets AS integer[])) AS t(k, h, b)
        CROSS JOIN LATERAL (
            SELECT min(r.first_step) AS first_step, min(r.low) AS low, max(r.high) AS high,
                   max(r.last_step) AS last_step, (array_agg(r.last_value ORDER BY r.last_step DESC))[1] AS last_value
            FROM step_metric_rollups r
            WHERE r.run_id = :run_id AND r.key = t.k AND r.host = t.h AND r.level = :below
              AND r.bucket >= t.b * :ratio AND r.bucket < (t.b + 1) * :ratio) AS a
        WHERE a.last_step IS NOT NULL
        {_UPSERT_ROLLUP}"""),
}
# SQLite (in-process, no round trips): one small statement per touched bucket, run as executemany.
_SQLITE_REFRESH = {
    "raw": text(f"""
        INSERT INTO step_metric_rollups ({_ROLLUP_COLUMNS})
        SELECT run_id, key, host, :level, :bucket, min(step), min(value), max(value), max(step),
               (SELECT m.value FROM step_metrics m WHERE m.run_id = :run_id AND m.key = :key AND m.host = :host
                AND m.step >= :start AND m.step < :stop ORDER BY m.step DESC LIMIT 1)
        FROM step_metrics
        WHERE run_id = :run_id AND key = :key AND host = :host AND step >= :start AND step < :stop
        GROUP BY run_id, key, host
        {_UPSERT_ROLLUP}"""),
    "rollup": text(f"""
        INSERT INTO step_metric_rollups ({_ROLLUP_COLUMNS})
        SELECT run_id, key, host, :level, :bucket, min(first_step), min(low), max(high), max(last_step),
               (SELECT r.last_value FROM step_metric_rollups r WHERE r.run_id = :run_id AND r.key = :key
                AND r.host = :host AND r.level = :below AND r.bucket >= :start AND r.bucket < :stop
                ORDER BY r.bucket DESC LIMIT 1)
        FROM step_metric_rollups
        WHERE run_id = :run_id AND key = :key AND host = :host AND level = :below AND bucket >= :start AND bucket < :stop
        GROUP BY run_id, key, host
        {_UPSERT_ROLLUP}"""),
}


# Merge into a per-series row. SET expressions read the row as it was, so the order of the assignments
# does not matter.
_SERIES_MERGE = """
    ON CONFLICT (run_id, key, host) DO UPDATE SET
        values_posted = step_metric_series.values_posted + excluded.values_posted,
        first_step = CASE WHEN excluded.first_step < step_metric_series.first_step
                          THEN excluded.first_step ELSE step_metric_series.first_step END,
        last_value = CASE WHEN excluded.last_step >= step_metric_series.last_step
                          THEN excluded.last_value ELSE step_metric_series.last_value END,
        last_step = CASE WHEN excluded.last_step > step_metric_series.last_step
                         THEN excluded.last_step ELSE step_metric_series.last_step END
"""
# SQLite's per-series upsert (PostgreSQL merges series rows in _PG_MERGE).
_UPSERT_SERIES = text(f"""
    INSERT INTO step_metric_series (run_id, key, host, first_step, last_step, last_value, values_posted)
    VALUES (:run_id, :key, :host, :first_step, :last_step, :last_value, :values_posted)
    {_SERIES_MERGE}""")

# PostgreSQL history: one statement for several series, each walked by its own index range scan.
_PG_SERIES = "unnest(CAST(:keys AS varchar[]), CAST(:hosts AS integer[])) AS t(k, h)"
_PG_HISTORY = {
    "points": text(f"""
        SELECT t.k, t.h, m.step, m.value, m.value, m.value FROM {_PG_SERIES}
        CROSS JOIN LATERAL (SELECT step, value FROM step_metrics
                            WHERE run_id = :run_id AND key = t.k AND host = t.h AND step BETWEEN :lo AND :hi) AS m"""),
    "raw": text(f"""
        SELECT t.k, t.h, b.last_step, b.last_value, b.low, b.high FROM {_PG_SERIES}
        CROSS JOIN LATERAL (
            SELECT max(step) AS last_step, (array_agg(value ORDER BY step DESC))[1] AS last_value,
                   min(value) AS low, max(value) AS high
            FROM step_metrics WHERE run_id = :run_id AND key = t.k AND host = t.h AND step BETWEEN :lo AND :hi
            GROUP BY step / :width) AS b"""),
    "rollup": text(f"""
        SELECT t.k, t.h, b.last_step, b.last_value, b.low, b.high FROM {_PG_SERIES}
        CROSS JOIN LATERAL (
            SELECT max(last_step) AS last_step, (array_agg(last_value ORDER BY last_step DESC))[1] AS last_value,
                   min(low) AS low, max(high) AS high
            FROM step_metric_rollups
            WHERE run_id = :run_id AND key = t.k AND host = t.h AND level = :level
              AND bucket BETWEEN :lo / :level AND :hi / :level
            GROUP BY bucket / (:width / :level)) AS b"""),
}


class BatchTooLargeError(ApiError):
    status_code = 413
    code = "BATCH_TOO_LARGE"


def _ensure_run(session: Session, run_id: int, *, lock: bool = False) -> None:
    query = select(Run.id).where(Run.id == run_id)
    if lock:
        # FOR KEY SHARE (PostgreSQL; SQLite already serialises writers): the run cannot be deleted
        # until this ingest commits, which is what a foreign key would have ensured row by row.
        query = query.with_for_update(key_share=True, read=True)
    if session.scalar(query) is None:
        raise NotFoundError(f"run {run_id} not found", code="RUN_NOT_FOUND")


def _is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


# --- ingest -----------------------------------------------------------------------------------------

def _check_key_count(session: Session, run_id: int, keys: set[str], max_keys: int) -> None:
    """A run holds at most `max_keys` distinct metric keys: every history, summary and chart query walks
    a run's series, so a reporter inventing keys must not grow them without bound. (Two batches racing
    may each add keys under the limit and together pass it by a batch's worth; the bound still holds.)"""
    known = set(session.scalars(select(StepMetricSeries.key).distinct()
                                .where(StepMetricSeries.run_id == run_id, StepMetricSeries.key.in_(keys))))
    new = keys - known
    if not new:
        return
    have = session.scalar(select(func.count(distinct(StepMetricSeries.key))).where(StepMetricSeries.run_id == run_id))
    if have + len(new) > max_keys:
        raise InvalidInputError(
            f"rows.values: run {run_id} has {have} metric keys and this batch adds {len(new)}; at most {max_keys} "
            "distinct keys are kept per run", code="TOO_MANY_METRIC_KEYS",
            details=[{"field": "rows.values", "message": f"at most {max_keys} distinct keys per run",
                      "have": have, "new": len(new)}])


def ingest(session: Session, run_id: int, batch: MetricsBatch, *, max_values: int, max_keys: int = 1_000) -> int:
    """Upsert a validated batch; returns the number of distinct (key, host, step) values written."""
    total = sum(len(row.values) for row in batch.rows)
    if total > max_values:
        raise BatchTooLargeError(f"batch has {total} values; the limit is {max_values} per request",
                                 details={"values": total, "limit": max_values})
    _ensure_run(session, run_id, lock=True)
    # Collapse repeats inside the batch (last one wins): PostgreSQL refuses an ON CONFLICT DO UPDATE
    # that touches the same row twice in one statement.
    merged: dict[tuple[str, int, int], float] = {}
    posted: dict[Series, int] = defaultdict(int)  # every value received, repeats included
    for row in batch.rows:
        for key, value in row.values.items():
            merged[(key, row.host, row.step)] = value
            posted[(key, row.host)] += 1
    _check_key_count(session, run_id, {key for key, _, _ in merged}, max_keys)

    if _is_postgres(session):
        _ingest_postgres(session, run_id, merged, posted)
    else:
        statement = sqlite.insert(StepMetric)
        statement = statement.on_conflict_do_update(
            index_elements=["run_id", "key", "host", "step"], set_={"value": statement.excluded.value})
        session.execute(statement, [
            {"run_id": run_id, "key": key, "host": host, "step": step, "value": value}
            for (key, host, step), value in merged.items()
        ])
        # SQLite runs in-process: recomputing the touched buckets from stored rows costs no round trips.
        refresh_rollups(session, run_id, merged)
        _update_series(session, run_id, merged, posted)
    session.commit()
    return len(merged)


def _ingest_postgres(session: Session, run_id: int, merged: dict[tuple[str, int, int], float],
                     posted: dict[Series, int]) -> None:
    keys, hosts, steps = (list(column) for column in zip(*merged))
    batch = {"run_id": run_id, "keys": keys, "hosts": hosts, "steps": steps, "vals": list(merged.values())}
    changed: list[tuple[str, int, int]] = []
    try:
        with session.begin_nested():  # a savepoint, so a duplicate row only undoes this attempt
            driver = session.connection().connection.driver_connection  # the psycopg connection, same transaction
            with driver.cursor() as cursor, cursor.copy(_PG_COPY) as copy:
                copy.set_types(_PG_COPY_TYPES)
                for (key, host, step), value in merged.items():
                    copy.write_row((run_id, key, host, step, value))
    except UniqueViolation:
        changed = [tuple(row) for row in session.execute(_PG_UPSERT, batch).all()]

    rollups: dict[tuple[str, int, int, int], list] = {}
    series: dict[Series, list] = {}
    for (key, host, step), value in merged.items():
        for level in ROLLUP_LEVELS:
            _fold(rollups, (key, host, level, step // level), step, value)
        _fold(series, (key, host), step, value)
    r_rows, s_rows = sorted(rollups.items()), sorted(series.items())
    session.execute(_PG_MERGE, {
        "run_id": run_id,
        "r_keys": [k[0] for k, _ in r_rows], "r_hosts": [k[1] for k, _ in r_rows], "r_levels": [k[2] for k, _ in r_rows],
        "r_buckets": [k[3] for k, _ in r_rows], "r_firsts": [a[0] for _, a in r_rows], "r_lows": [a[1] for _, a in r_rows],
        "r_highs": [a[2] for _, a in r_rows], "r_lasts": [a[3] for _, a in r_rows], "r_values": [a[4] for _, a in r_rows],
        "s_keys": [k[0] for k, _ in s_rows], "s_hosts": [k[1] for k, _ in s_rows], "s_firsts": [a[0] for _, a in s_rows],
        "s_lasts": [a[3] for _, a in s_rows], "s_values": [a[4] for _, a in s_rows],
        "s_posted": [posted[k] for k, _ in s_rows],
    })
    if changed:
        # A changed value can lower a max or raise a min: merging cannot express that, recomputing can.
        refresh_rollups(session, run_id, changed)


def _fold(aggregates: dict, group: tuple, step: int, value: float) -> None:
    """Fold one point into [first step, min, max, last step, last value] of its group."""
    current = aggregates.get(group)
    if current is None:
        aggregates[group] = [step, value, value, step, value]
        return
    if step < current[0]:
        current[0] = step
    if value < current[1]:
        current[1] = value
    if value > current[2]:
        current[2] = value
    if step > current[3]:
        current[3], current[4] = step, value


def _update_series(session: Session, run_id: int, merged: dict[tuple[str, int, int], float],
                   posted: dict[Series, int] | None = None) -> None:
    """Merge `merged` into the series rows; `posted`: values received per series (default: one per value)."""
    if posted is None:
        posted = defaultdict(int)
        for key, host, _ in merged:
            posted[(key, host)] += 1
    ranges: dict[Series, list] = {}
    for (key, host, step), value in merged.items():
        current = ranges.get((key, host))
        if current is None:
            ranges[(key, host)] = [step, step, value]
        else:
            current[0] = min(current[0], step)
            if step > current[1]:
                current[1], current[2] = step, value
    session.execute(_UPSERT_SERIES, [
        {"run_id": run_id, "key": key, "host": host, "first_step": first, "last_step": last, "last_value": value,
         "values_posted": posted[(key, host)]}
        for (key, host), (first, last, value) in sorted(ranges.items())
    ])


def refresh_rollups(session: Session, run_id: int, written: Iterable[tuple[str, int, int]]) -> None:
    """Recompute every rollup bucket that contains one of the written (key, host, step)."""
    postgres = _is_postgres(session)
    touched = set(written)
    below = 1
    for level in ROLLUP_LEVELS:
        ratio = level // below
        touched = {(key, host, position // ratio) for key, host, position in touched}
        kind = "raw" if below == 1 else "rollup"
        ordered = sorted(touched)
        if postgres:
            keys, hosts, buckets = (list(column) for column in zip(*ordered))
            session.execute(_PG_REFRESH[kind], {"run_id": run_id, "level": level, "below": below, "ratio": ratio,
                                                "keys": keys, "hosts": hosts, "buckets": buckets})
        else:
            session.execute(_SQLITE_REFRESH[kind], [
                {"run_id": run_id, "key": key, "host": host, "level": level, "below": below, "bucket": bucket,
                 "start": bucket * ratio, "stop": (bucket + 1) * ratio}
                for key, host, bucket in ordered
            ])
        below = level


# --- history ----------------------------------------------------------------------------------------

def bucket_plan(lo: int, hi: int, max_points: int, start_step: int | None = None,
                end_step: int | None = None) -> tuple[int, int]:
    """(width, level) for steps [lo, hi]: buckets `step // width`, at most `max_points` of them.

    `level` is the largest rollup level that fits inside a bucket (1 = raw rows) and whose buckets do
    not straddle the requested window's edges; `width` is a multiple of it.
    """
    base = math.ceil((hi - lo + 1) / max_points)
    level = 1
    for candidate in ROLLUP_LEVELS:
        aligned = (start_step is None or start_step % candidate == 0) and \
                  (end_step is None or (end_step + 1) % candidate == 0)
        if candidate <= base and aligned:
            level = candidate
    width = level * math.ceil(base / level)
    while hi // width - lo // width + 1 > max_points:
        width += level
    return width, level


def _bounds(session: Session, run_id: int, keys: Sequence[str], hosts: Sequence[int]) -> dict[Series, tuple[int, int]]:
    """First and last step of each series that exists."""
    series = StepMetricSeries
    rows = session.execute(
        select(series.key, series.host, series.first_step, series.last_step)
        .where(series.run_id == run_id, tuple_(series.key, series.host).in_([(k, h) for k in keys for h in hosts]))
    ).tuples().all()
    return {(key, host): (first, last) for key, host, first, last in rows}


def history(session: Session, run_id: int, keys: Sequence[str], hosts: Sequence[int], *, max_points: int,
            start_step: int | None = None, end_step: int | None = None) -> list[MetricSeries]:
    _ensure_run(session, run_id)
    keys, hosts = list(dict.fromkeys(keys)), list(dict.fromkeys(hosts))
    bounds = _bounds(session, run_id, keys, hosts)
    plans: dict[tuple[int, int, int, int], list[Series]] = defaultdict(list)
    for series, (first, last) in bounds.items():
        lo = first if start_step is None else max(first, start_step)
        hi = last if end_step is None else min(last, end_step)
        if lo <= hi:
            width, level = bucket_plan(lo, hi, max_points, start_step, end_step)
            plans[(lo, hi, width, level)].append(series)

    results: dict[Series, list[Bucket]] = {}
    widths: dict[Series, int] = {}
    for (lo, hi, width, level), members in plans.items():
        results.update(_query_buckets(session, run_id, members, lo, hi, width, level))
        widths.update(dict.fromkeys(members, width))
    out = []
    for key in keys:
        for host in hosts:
            points = results.get((key, host), [])
            out.append(MetricSeries(
                key=key, host=host, steps=[p[0] for p in points], last=[p[1] for p in points],
                min=[p[2] for p in points], max=[p[3] for p in points], bucket_steps=widths.get((key, host), 1)))
    return out


def _query_buckets(session: Session, run_id: int, members: list[Series], lo: int, hi: int, width: int,
                   level: int) -> dict[Series, list[Bucket]]:
    """Buckets of several series that share one plan."""
    found: dict[Series, list[Bucket]] = defaultdict(list)
    if _is_postgres(session):
        kind = "points" if width == 1 else ("raw" if level == 1 else "rollup")
        rows = session.execute(_PG_HISTORY[kind], {
            "run_id": run_id, "keys": [key for key, _ in members], "hosts": [host for _, host in members],
            "lo": lo, "hi": hi, "width": width, "level": level}).tuples().all()  # fetchall: rows come in one go
        for key, host, at, val, minimum, maximum in rows:
            found[(key, host)].append((at, val, minimum, maximum))
    else:
        found = _query_buckets_portable(session, run_id, members, lo, hi, width, level)
    return {series: sorted(points) for series, points in found.items()}


def _query_buckets_portable(session: Session, run_id: int, members: list[Series], lo: int, hi: int, width: int,
                            level: int) -> dict[Series, list[Bucket]]:
    """SQLite: the same buckets with plain SQL; having no ordered aggregate, it reads each bucket's last
    value in a second statement (in-process, so the extra statement costs no round trip)."""
    member_filter = [(key, host) for key, host in members]
    if level == 1:
        table, step, low, high, value = StepMetric, StepMetric.step, StepMetric.value, StepMetric.value, StepMetric.value
        where = [StepMetric.run_id == run_id, tuple_(StepMetric.key, StepMetric.host).in_(member_filter),
                 StepMetric.step >= lo, StepMetric.step <= hi]
        group = StepMetric.step // width  # floor division of non-negative ints
    else:
        rollup = StepMetricRollup
        table, step, low, high, value = rollup, rollup.last_step, rollup.low, rollup.high, rollup.last_value
        where = [rollup.run_id == run_id, tuple_(rollup.key, rollup.host).in_(member_filter), rollup.level == level,
                 rollup.bucket >= lo // level, rollup.bucket <= hi // level]
        group = rollup.bucket // (width // level)
    found: dict[Series, list[Bucket]] = defaultdict(list)
    if width == 1:
        for key, host, at, val in session.execute(select(table.key, table.host, step, value).where(*where)).tuples().all():
            found[(key, host)].append((at, val, val, val))
        return found
    rows = session.execute(
        select(table.key, table.host, func.max(step), func.min(low), func.max(high))
        .where(*where).group_by(table.key, table.host, group)
    ).tuples().all()
    values = _values_at(session, run_id, level, [(key, host, at) for key, host, at, _, _ in rows])
    for key, host, at, minimum, maximum in rows:
        found[(key, host)].append((at, values[(key, host, at)], minimum, maximum))
    return found


def _values_at(session: Session, run_id: int, level: int, points: list[tuple[str, int, int]]
               ) -> dict[tuple[str, int, int], float]:
    if not points:
        return {}
    if level == 1:
        table, step, value = StepMetric, StepMetric.step, StepMetric.value
        where = [tuple_(StepMetric.key, StepMetric.host, StepMetric.step).in_(points)]
    else:
        table, step, value = StepMetricRollup, StepMetricRollup.last_step, StepMetricRollup.last_value
        where = [StepMetricRollup.level == level, tuple_(StepMetricRollup.key, StepMetricRollup.host,
                                                         StepMetricRollup.bucket).in_(
            [(key, host, at // level) for key, host, at in points])]
    rows = session.execute(select(table.key, table.host, step, value).where(table.run_id == run_id, *where)).tuples().all()
    return {(key, host, at): val for key, host, at, val in rows}


# --- latest values ----------------------------------------------------------------------------------

def summary(session: Session, run_id: int, host: int) -> dict[str, tuple[int, float]]:
    """Latest (step, value) of every key of one host."""
    _ensure_run(session, run_id)
    series = StepMetricSeries
    rows = session.execute(
        select(series.key, series.last_step, series.last_value)
        .where(series.run_id == run_id, series.host == host).order_by(series.key)
    ).tuples().all()
    return {key: (step, value) for key, step, value in rows}


def keys(session: Session, run_id: int) -> tuple[list[str], list[int]]:
    _ensure_run(session, run_id)
    rows = session.execute(
        select(StepMetricSeries.key, StepMetricSeries.host).where(StepMetricSeries.run_id == run_id)
    ).tuples().all()
    return sorted({key for key, _ in rows}), sorted({host for _, host in rows})


def deliveries(session: Session, run_id: int) -> list[tuple[str, int, int, int]]:
    """(key, host, values posted, rows stored) of every series: what the API received against what it
    keeps. posted > stored means some values arrived more than once (retries, a step posted again by a
    restarted relay), which the upsert collapses; posted < stored cannot happen."""
    _ensure_run(session, run_id)
    stored = dict(((key, host), count) for key, host, count in session.execute(
        select(StepMetric.key, StepMetric.host, func.count()).where(StepMetric.run_id == run_id)
        .group_by(StepMetric.key, StepMetric.host)).tuples())
    rows = session.execute(
        select(StepMetricSeries.key, StepMetricSeries.host, StepMetricSeries.values_posted)
        .where(StepMetricSeries.run_id == run_id).order_by(StepMetricSeries.key, StepMetricSeries.host)).tuples()
    return [(key, host, posted, stored.get((key, host), 0)) for key, host, posted in rows]
