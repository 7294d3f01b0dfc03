"""/healthz (process up), /readyz (database and broker reachable), /metrics (Prometheus)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.api.deps import DbDep, ReadToken, SettingsDep, errors, json_errors
from server.schemas import Health, Readiness
from server.services import health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """Liveness: answers while the process serves requests; touches nothing else."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses=errors(503))
async def readyz(db: DbDep, settings: SettingsDep) -> Response:
    """Ready when the database answers and the Celery broker accepts a connection; 503 otherwise."""
    checks: dict[str, str] = {}

    async def database() -> None:
        checks["database"] = await anyio.to_thread.run_sync(health.check_database, db, abandon_on_cancel=True)

    async def broker() -> None:
        checks["broker"] = await anyio.to_thread.run_sync(health.check_broker, settings.broker_url,
                                                          settings.readyz_timeout_s, abandon_on_cancel=True)

    # A hung connect (a firewalled broker) must not hang the probe: give up on the thread after the budget.
    with anyio.move_on_after(settings.readyz_timeout_s * 2):
        async with anyio.create_task_group() as group:
            group.start_soon(database)
            group.start_soon(broker)
    checks.setdefault("database", "error: timeout")
    checks.setdefault("broker", "error: timeout")
    if all(value == "ok" for value in checks.values()):
        return JSONResponse(Readiness(status="ready", checks=checks).model_dump())
    failing = sorted(name for name, value in checks.items() if value != "ok")
    return JSONResponse(status_code=503, content={"error": {
        "code": "NOT_READY", "message": f"not ready: {', '.join(failing)} unreachable", "details": checks}})


@router.get("/metrics", response_class=Response, responses={
    200: {"description": "Prometheus text exposition", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
    **json_errors(401)})
def prometheus_metrics(request: Request, _: ReadToken) -> Response:
    """Request counts and latencies per route, run transitions, ingested metric values, runs per status."""
    return Response(generate_latest(request.app.state.prometheus.registry), media_type=CONTENT_TYPE_LATEST)
