"""The FastAPI application factory: `create_app(settings)`.

Everything the app needs arrives in `settings`; nothing here reads the environment. Extra routers (the
dashboard) join through the `locojax.server_plugins` entry-point group — each entry is a callable
`register(app, settings)` — so the API never imports the packages that build on it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import entry_points
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from locojax.contract import validation_message
from server.api import calibration, catalog, events, health, hosts, metrics, placement, runs, tokens
from server.api.deps import StreamSlots, reject_nul_characters
from server.db import Database, upgrade_to_head
from server.errors import ApiError
from server.middleware import BodySizeLimitMiddleware, SecurityHeadersMiddleware
from server.observability import Prometheus, PrometheusMiddleware
from server.services.tokens import TokenCache
from server.settings import Settings

log = logging.getLogger("locojax.server")

_HTTP_CODES = {
    400: "BAD_REQUEST", 401: "AUTH_REQUIRED", 403: "FORBIDDEN", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED",
    406: "NOT_ACCEPTABLE", 409: "CONFLICT", 413: "PAYLOAD_TOO_LARGE", 415: "UNSUPPORTED_MEDIA_TYPE",
    422: "VALIDATION_ERROR", 429: "TOO_MANY_REQUESTS", 503: "UNAVAILABLE",
}


def _error(status_code: int, code: str, message: str, details: Any = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status_code, headers=headers,
                        content={"error": {"code": code, "message": message, "details": details}})


def _field_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    details = []
    for error in exc.errors():
        location, *path = error.get("loc", ()) or ("body",)
        if error.get("type") == "json_invalid":
            path = []  # the position inside the document, not a field
        details.append({"field": ".".join(str(part) for part in path), "location": str(location),
                        "message": validation_message(error),
                        "type": error.get("type", "")})
    return details


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status_code, exc.code, exc.message, exc.details, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = _field_errors(exc)
        first = details[0] if details else {"field": "", "message": "invalid request"}
        more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
        message = f"{first['field'] or first.get('location', 'request')}: {first['message']}{more}"
        return _error(422, "VALIDATION_ERROR", message, details)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            # FastAPI's only 400 is a body it could not decode; every other malformed body is a 422, so
            # clients see one status for "your body is wrong". FastAPI wraps the decoder's exception
            # (`raise ... from`): name what it was.
            cause = exc.__cause__
            if isinstance(cause, RecursionError):
                problem, kind = "nested too deeply", "json_invalid"
            elif isinstance(cause, UnicodeDecodeError):
                problem, kind = f"not UTF-8 ({cause.reason} at byte {cause.start})", "body_parsing"
            else:
                problem, kind = "could not be parsed as UTF-8 JSON", "body_parsing"
            return _error(422, "VALIDATION_ERROR", f"body: {problem}",
                          [{"field": "", "location": "body", "message": problem, "type": kind}])
        code = _HTTP_CODES.get(exc.status_code, f"HTTP_{exc.status_code}")
        return _error(exc.status_code, code, str(exc.detail), None, dict(exc.headers or {}))

    @app.exception_handler(OperationalError)
    async def database_unavailable(_: Request, exc: OperationalError) -> JSONResponse:
        # Connection refused, server restarting, SQLite busy past its timeout: all worth a retry.
        log.warning("database unavailable: %s", type(exc.orig).__name__ if exc.orig else exc)
        return _error(503, "DATABASE_UNAVAILABLE", "the database is unavailable; retry shortly",
                      headers={"Retry-After": "2"})

    @app.exception_handler(DataError)
    async def unstorable_value(_: Request, exc: DataError) -> JSONResponse:
        # Validation should stop such values first; if one slips through, it is still the client's value.
        log.warning("value refused by the database: %s", type(exc.orig).__name__ if exc.orig else exc)
        return _error(422, "VALIDATION_ERROR", "a value cannot be stored (out of range or invalid characters)",
                      [{"field": "", "location": "body", "message": "refused by the database", "type": "data_error"}])

    @app.exception_handler(RecursionError)
    async def too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        # json.loads gives up on deeply nested documents with RecursionError, not a decode error.
        return _error(422, "VALIDATION_ERROR", "body: nested too deeply",
                      [{"field": "", "location": "body", "message": "nested too deeply", "type": "json_invalid"}])

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "INTERNAL_ERROR", "internal server error")


def _load_plugins(app: FastAPI, settings: Settings) -> None:
    for entry in entry_points(group="locojax.server_plugins"):
        entry.load()(app, settings)


def create_app(settings: Settings, *, plugins: bool = True) -> FastAPI:
    db = Database(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.migrate_on_start:
            await anyio.to_thread.run_sync(upgrade_to_head, settings.database_url)
        scheduler = None
        if settings.scheduler_enabled:
            from server.scheduler import CeleryDispatcher, SchedulerLoop

            scheduler = SchedulerLoop(db, settings, CeleryDispatcher(settings.broker_url))
            scheduler.start()
        app.state.scheduler = scheduler
        try:
            yield
        finally:
            if scheduler is not None:
                await anyio.to_thread.run_sync(scheduler.stop)
            db.dispose()

    app = FastAPI(
        title="LoCoJAX control plane",
        version="0.1.0",
        summary="Submit and watch GRPO runs, ingest their metrics, and ask where to place them.",
        description="Every route except `/healthz`, `/readyz` and the docs needs `Authorization: Bearer <token>` "
                    "(`locojax token create --scope submit`). Errors are always "
                    '`{"error": {"code", "message", "details"}}`.',
        lifespan=lifespan,
        dependencies=[Depends(reject_nul_characters)],
    )
    app.state.settings = settings
    app.state.db = db
    app.state.scheduler = None
    app.state.prometheus = Prometheus(db, settings)
    app.state.token_cache = TokenCache(settings.token_cache_s)
    app.state.stream_slots = StreamSlots(settings.sse_streams_per_token)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(PrometheusMiddleware, prometheus=app.state.prometheus)
    app.add_middleware(SecurityHeadersMiddleware)
    if settings.trusted_hosts != ["*"]:
        # Outermost: a request for another Host (DNS rebinding, a stray vhost) gets 400 before anything runs.
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.trusted_hosts)
    _install_error_handlers(app)

    # Routers carry their full path (API_PREFIX included) so route templates in metrics are complete.
    for module in (health, runs, metrics, events, hosts, placement, calibration, catalog, tokens):
        app.include_router(module.router)
    if plugins:
        _load_plugins(app, settings)
    return app
