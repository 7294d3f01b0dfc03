"""Runs list and run page, their partials (one per swap target), the events stream, cancel and resume."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any
from urllib.parse import urlencode

import anyio
from fastapi import Depends, Header, Query, Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from starlette.responses import RedirectResponse, Response

from server.api.deps import DbDep, RunId, SessionDep, SettingsDep
from server.db import Database
from server.errors import ApiError
from server.models import RunStatus
from server.services import dashboard as dashboard_service
from server.services import events as event_service
from server.services import runs as run_service
from web import learning, run_page
from web.auth import SubmitterDep, Viewer, ViewerDep
from web.routing import dashboard_router
from web.templating import is_htmx, render, templates

router = dashboard_router()

MAX_EVENT_ID = 2**63 - 1


@router.get("/")
async def home() -> Response:
    return RedirectResponse("/runs", status_code=303)


# --- runs list --------------------------------------------------------------------------------------

@router.get("/runs")
def runs_list(request: Request, session: SessionDep, settings: SettingsDep, viewer: ViewerDep,
              status: Annotated[list[str], Query(max_length=8)] = [],
              name: Annotated[str, Query(max_length=128)] = "",
              cursor: Annotated[str, Query(max_length=64)] = "") -> Response:
    # The filter form sends an empty value for "any"; names that are not statuses are ignored likewise.
    statuses = [RunStatus(value) for value in status if value in RunStatus.__members__]
    runs, next_cursor = run_service.list_page(session, limit=settings.page_size_default, cursor=cursor or None,
                                              statuses=statuses or None, name=name.strip() or None)
    filters = [("status", value.value) for value in statuses] + ([("name", name.strip())] if name.strip() else [])
    context = dict(runs=runs, cursor=cursor, statuses=[value.value for value in statuses], name=name.strip(),
                   all_statuses=[value.value for value in RunStatus], newest_url="/runs?" + urlencode(filters),
                   older_url="/runs?" + urlencode([*filters, ("cursor", next_cursor)]) if next_cursor else None)
    return render(request, "_runs_table.html" if is_htmx(request) else "runs.html", **context)


@router.get("/runs/{run_id:int}/status")
def run_status_badge(request: Request, run_id: RunId, session: SessionDep, _: ViewerDep) -> Response:
    return render(request, "_run_status.html", run=run_service.get(session, run_id))


# --- run page ---------------------------------------------------------------------------------------

@router.get("/runs/{run_id:int}")
def run_detail(request: Request, run_id: RunId, session: SessionDep, settings: SettingsDep, _: ViewerDep) -> Response:
    run = run_service.get(session, run_id)
    latest = run_page.latest(session, run_id)
    events = run_page.events_tail(session, run_id)
    return render(
        request, "run.html", run=run, header=run_page.header(run, latest), latest=latest,
        processes=run_page.host_processes(session, run, settings), events=events,
        last_event_id=events[-1].id if events else 0, decision=run_page.decision(session, run, latest),
        prediction=learning.run_prediction(session, run, latest, settings),
        charts=run_page.charts(session, run_id, settings),
    )


@router.get("/runs/{run_id:int}/header")
def run_header(request: Request, run_id: RunId, session: SessionDep, _: ViewerDep) -> Response:
    run = run_service.get(session, run_id)
    return render(request, "_run_header.html", run=run, header=run_page.header(run, run_page.latest(session, run_id)))


@router.get("/runs/{run_id:int}/latest")
def run_latest(request: Request, run_id: RunId, session: SessionDep, _: ViewerDep) -> Response:
    run = run_service.get(session, run_id)
    return render(request, "_run_latest.html", run=run, latest=run_page.latest(session, run_id))


@router.get("/runs/{run_id:int}/processes")
def run_processes(request: Request, run_id: RunId, session: SessionDep, settings: SettingsDep, _: ViewerDep) -> Response:
    run = run_service.get(session, run_id)
    return render(request, "_run_hosts.html", run=run, processes=run_page.host_processes(session, run, settings))


@router.get("/runs/{run_id:int}/decision")
def run_decision(request: Request, run_id: RunId, session: SessionDep, _: ViewerDep) -> Response:
    run = run_service.get(session, run_id)
    return render(request, "_run_decision.html", run=run,
                  decision=run_page.decision(session, run, run_page.latest(session, run_id)))


@router.get("/runs/{run_id:int}/prediction")
def run_prediction(request: Request, run_id: RunId, session: SessionDep, settings: SettingsDep,
                   _: ViewerDep) -> Response:
    run = run_service.get(session, run_id)
    return render(request, "_run_prediction.html", run=run,
                  prediction=learning.run_prediction(session, run, run_page.latest(session, run_id), settings))


@router.get("/runs/{run_id:int}/charts.json")
def run_charts(run_id: RunId, session: SessionDep, settings: SettingsDep, _: ViewerDep) -> JSONResponse:
    run = run_service.get(session, run_id)
    return JSONResponse(run_page.charts_payload(session, run, settings))


# --- events over SSE --------------------------------------------------------------------------------

def _poll_events(db: Database, run_id: RunId, after: int, limit: int) -> tuple[RunStatus | None, list]:
    with db.read_session() as session:
        # Status before events: a transition commits its event with the new status, so whoever reads a
        # terminal status here finds every event of the run in the read that follows.
        status = dashboard_service.run_status(session, run_id)
        rows = event_service.list_after(session, run_id, after, limit)
        session.expunge_all()
        return status, rows


async def _stream_slot(request: Request, viewer: ViewerDep) -> AsyncIterator[None]:
    """The dashboard's streams count against the same per-token cap as the API's (server.api.deps.StreamSlots)."""
    slots = request.app.state.stream_slots
    slots.acquire(viewer.token_id)
    try:
        yield
    finally:
        slots.release(viewer.token_id)


@router.get("/runs/{run_id:int}/events/stream", response_class=EventSourceResponse)
async def run_events_stream(request: Request, run_id: RunId, db: DbDep, settings: SettingsDep,
                            _: Annotated[None, Depends(_stream_slot)],
                            after: Annotated[int, Query(ge=0, le=MAX_EVENT_ID)] = 0,
                            last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)] = None,
                            ) -> AsyncIterator[ServerSentEvent]:
    """`log` events carry one rendered `_event_row.html`; `end` says the run is finished (the script
    closes the stream then, so EventSource does not reconnect). Streams close after `sse_max_s` and the
    browser reconnects with Last-Event-ID."""
    cursor = after
    if last_event_id and last_event_id.isdigit():
        cursor = max(cursor, min(int(last_event_id), MAX_EVENT_ID))
    row_template = templates.get_template("_event_row.html")
    batch_size = 200
    deadline = time.monotonic() + settings.sse_max_s
    while True:
        status, batch = await anyio.to_thread.run_sync(_poll_events, db, run_id, cursor, batch_size)
        if status is None:
            yield ServerSentEvent(event="end", raw_data="run deleted")
            return
        for event in batch:
            cursor = event.id
            yield ServerSentEvent(event="log", id=str(event.id), raw_data=row_template.render(event=event))
        if len(batch) == batch_size:
            continue  # more are waiting; drain before sleeping
        if RunStatus(status).terminal:
            yield ServerSentEvent(event="end", raw_data=RunStatus(status).value)
            return
        if time.monotonic() >= deadline or await request.is_disconnected():
            return
        await anyio.sleep(settings.sse_poll_s)


# --- actions ----------------------------------------------------------------------------------------

def _after_action(request: Request, session: SessionDep, run_id: RunId, error: ApiError | None = None) -> Response:
    """htmx: the new header (with the action's error in it, if any); plain form: back to the run page."""
    if not is_htmx(request):
        if error is not None:
            raise error
        return RedirectResponse(f"/runs/{run_id}", status_code=303)
    run = run_service.get(session, run_id)
    session.refresh(run)
    return render(request, "_run_header.html", run=run, action_error=error.message if error else None,
                  header=run_page.header(run, run_page.latest(session, run_id)))


def _run_action(request: Request, session: Any, run_id: int, action: Callable[..., Any], viewer: Viewer,
                what: str) -> Response:
    """Cancel or resume through the runs service; a refusal (403 for another token's run, 409) is shown in
    the header it re-renders."""
    try:
        run = run_service.get(session, run_id)
        viewer.check_may_act_on(run, what)
        action(session, run_id, by=viewer.name)
    except ApiError as exc:
        session.rollback()
        return _after_action(request, session, run_id, exc)
    return _after_action(request, session, run_id)


@router.post("/runs/{run_id:int}/cancel")
def cancel_run(request: Request, run_id: RunId, session: SessionDep, viewer: SubmitterDep) -> Response:
    return _run_action(request, session, run_id, run_service.cancel, viewer, "cancel")


@router.post("/runs/{run_id:int}/resume")
def resume_run(request: Request, run_id: RunId, session: SessionDep, viewer: SubmitterDep) -> Response:
    return _run_action(request, session, run_id, run_service.resume, viewer, "resume")
