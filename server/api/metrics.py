"""/api/v1/runs/{run_id}/metrics: batch ingest (workers), history with downsampling, summary, keys, deliveries."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from server.api.deps import API_PREFIX, MAX_INT32, ReadToken, RunId, SessionDep, SettingsDep, WorkerToken, errors
from server.errors import InvalidInputError
from server.models import AGGREGATE_HOST
from server.schemas import (
    HostIndex,
    IngestResult,
    MetricDeliveries,
    MetricDelivery,
    MetricHistory,
    MetricKey,
    MetricKeys,
    MetricLatest,
    MetricsBatch,
    MetricSummary,
)
from server.services import attempts
from server.services import metrics as metric_service
from server.services import runs as run_service

router = APIRouter(prefix=API_PREFIX + "/runs/{run_id}/metrics", tags=["metrics"], responses=errors(401, 403, 404, 422))


@router.post("", response_model=IngestResult, responses=errors(409, 413))
def ingest_metrics(run_id: RunId, body: MetricsBatch, request: Request, session: SessionDep,
                   settings: SettingsDep, token: WorkerToken) -> IngestResult:
    """Upsert a batch of per-step values, idempotent on (run, step, host, key). Validated as a whole
    first: one bad value rejects the batch and writes nothing. Only from a host with a process in the
    run's current attempt (403 HOST_NOT_PLACED), and only from its process 0, which writes every host's
    rows (403 NOT_METRICS_PROCESS); a stale attempt or a finished run is a 409."""
    run = run_service.get(session, run_id)
    process = attempts.reporting_process(session, run, token, body.attempt, "metrics", body.host_name)
    attempts.check_metrics_process(run, process)
    written = metric_service.ingest(session, run_id, body, max_values=settings.metrics_batch_max_values,
                                     max_keys=settings.metric_keys_per_run_max)
    request.app.state.prometheus.metric_values.inc(written)
    return IngestResult(run_id=run_id, values=written)


@router.get("/history", response_model=MetricHistory)
def metric_history(
    run_id: RunId, session: SessionDep, settings: SettingsDep, _: ReadToken,
    keys: Annotated[list[MetricKey], Query(alias="key", min_length=1, max_length=64, description="repeat for several keys")],
    hosts: Annotated[list[HostIndex], Query(alias="host", min_length=1, max_length=64,
                                            description="process indices; -1 (default) = aggregated")] = [AGGREGATE_HOST],
    max_points: Annotated[int, Query(ge=2, le=MAX_INT32, description="clamped to the server's maximum")] = 1000,
    start_step: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
    end_step: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
) -> MetricHistory:
    """One series per (key, host): raw points, or when longer than `max_points`, buckets carrying min,
    max and the last value; the newest step is always included."""
    series_count = len(set(keys)) * len(set(hosts))
    if series_count > settings.history_max_series:
        raise InvalidInputError.for_field("key", f"{series_count} series asked for; at most "
                                                 f"{settings.history_max_series} per request")
    points = min(max_points, settings.history_max_points)
    series = metric_service.history(session, run_id, keys, hosts, max_points=points, start_step=start_step,
                                    end_step=end_step)
    return MetricHistory(run_id=run_id, max_points=points, series=series)


@router.get("/summary", response_model=MetricSummary)
def metric_summary(run_id: RunId, session: SessionDep, _: ReadToken,
                   host: Annotated[HostIndex, Query()] = AGGREGATE_HOST) -> MetricSummary:
    """The latest value of every key (of the aggregated rows, or of one host)."""
    latest = metric_service.summary(session, run_id, host)
    return MetricSummary(
        run_id=run_id, host=host, last_step=max((step for step, _ in latest.values()), default=None),
        values={key: MetricLatest(step=step, value=value) for key, (step, value) in latest.items()},
    )


@router.get("/keys", response_model=MetricKeys)
def metric_keys(run_id: RunId, session: SessionDep, _: ReadToken) -> MetricKeys:
    keys, hosts = metric_service.keys(session, run_id)
    return MetricKeys(run_id=run_id, keys=keys, hosts=hosts)


@router.get("/deliveries", response_model=MetricDeliveries)
def metric_deliveries(run_id: RunId, session: SessionDep, _: ReadToken) -> MetricDeliveries:
    """Values received against rows stored, per series: duplicates that the upsert collapses stay countable."""
    return MetricDeliveries(run_id=run_id, series=[
        MetricDelivery(key=key, host=host, values_posted=posted, values_stored=stored)
        for key, host, posted, stored in metric_service.deliveries(session, run_id)])
