"""/api/v1/runs/{run_id}/events: append (workers), list after a cursor, follow over SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from sqlalchemy import select

from server.api.deps import API_PREFIX, DbDep, ReadToken, RunId, SessionDep, SettingsDep, WorkerToken, errors, json_errors
from server.db import Database
from server.errors import ApiError
from server.models import Run, RunStatus
from server.schemas import EventLevel, EventPublic, EventsAccepted, EventsCreate, EventsPublic
from server.api.deps import source_name
from server.services import attempts
from server.services import events as event_service
from server.services import runs as run_service

router = APIRouter(prefix=API_PREFIX + "/runs/{run_id}/events", tags=["events"])

MAX_EVENT_ID = 2**63 - 1
EventCursor = Annotated[int, Query(ge=0, le=MAX_EVENT_ID, description="return events with a larger id")]


class EventBatchTooLargeError(ApiError):
    status_code = 413
    code = "BATCH_TOO_LARGE"


@router.post("", response_model=EventsAccepted, responses=errors(401, 403, 404, 409, 413, 422))
def append_events(run_id: RunId, body: EventsCreate, session: SessionDep, settings: SettingsDep,
                  token: WorkerToken) -> EventsAccepted:
    """Append log lines of a current-attempt host process; events carrying a seq already stored for that
    process are skipped, so retries are safe. The server sets each event's `source` (`host<index>` of the
    reporting process) and `ts`; a stale attempt or a finished run is a 409."""
    if len(body.events) > settings.events_batch_max:
        raise EventBatchTooLargeError(f"{len(body.events)} events in one request; the limit is {settings.events_batch_max}")
    run = run_service.get(session, run_id)
    process = attempts.reporting_process(session, run, token, body.attempt, "events", body.host_name)
    source = f"host{process.process_index}" if process is not None else source_name(token)
    return EventsAccepted(run_id=run_id, accepted=event_service.append(session, run_id, body.events, source=source))


@router.get("", response_model=EventsPublic, responses=errors(401, 404, 422))
def list_events(run_id: RunId, session: SessionDep, settings: SettingsDep, _: ReadToken, after: EventCursor = 0,
                limit: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="clamped to the server's maximum")] = None,
                level: Annotated[EventLevel | None, Query()] = None) -> EventsPublic:
    run_service.get(session, run_id)
    page_size = min(limit or settings.page_size_max, settings.page_size_max)
    rows = event_service.list_after(session, run_id, after, page_size, level)
    return EventsPublic(data=[EventPublic.model_validate(row) for row in rows],
                        next_after=rows[-1].id if rows else after)


def _run_exists(run_id: RunId, session: SessionDep, token: ReadToken) -> tuple[int, int]:
    # Checked as a dependency so a missing run is an ordinary 404, before the stream starts (and
    # after authentication, so nobody learns which runs exist without a token).
    run_service.get(session, run_id)
    session.commit()
    return run_id, token.id


async def _stream_slot(request: Request, stream_of: Annotated[tuple[int, int], Depends(_run_exists)]
                       ) -> AsyncIterator[int]:
    """One of the token's stream slots, taken before the response starts (so the refusal is a 429) and
    given back when the stream ends (FastAPI exits a yield dependency after the response is sent)."""
    run_id, token_id = stream_of
    slots = request.app.state.stream_slots
    slots.acquire(token_id)
    try:
        yield run_id
    finally:
        slots.release(token_id)


def _poll(db: Database, run_id: int, after: int, limit: int) -> tuple[RunStatus | None, list[EventPublic]]:
    with db.read_session() as session:
        # Status first, then events: a transition commits its event together with the new status,
        # so whoever sees a terminal status here finds every event of the run in the next read.
        status = session.scalar(select(Run.status).where(Run.id == run_id))
        rows = event_service.list_after(session, run_id, after, limit)
        return status, [EventPublic.model_validate(row) for row in rows]


@router.get("/stream", response_class=EventSourceResponse,
            responses={200: {"description": "`log` events (data: an event), `status` on each change, `end` last",
                             "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                       **json_errors(401, 404, 422)})
async def follow_events(request: Request, run_id: Annotated[int, Depends(_stream_slot)], db: DbDep,
                        settings: SettingsDep, after: EventCursor = 0,
                        last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)] = None,
                        ) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events: the run's events after `after` (or `Last-Event-ID` on reconnect), then new ones
    as they arrive, until the run is finished. Streams close after `sse_max_s`; EventSource reconnects.
    A token holds at most `sse_streams_per_token` streams at once (429 past that)."""
    cursor = after
    if last_event_id and last_event_id.isdigit():
        cursor = max(cursor, min(int(last_event_id), MAX_EVENT_ID))
    batch_size = 500
    deadline = time.monotonic() + settings.sse_max_s
    last_status: RunStatus | None = None
    while True:
        status, batch = await anyio.to_thread.run_sync(_poll, db, run_id, cursor, batch_size)
        if status is None:
            yield ServerSentEvent(event="end", data={"reason": "run deleted"})
            return
        if status != last_status:
            last_status = status
            yield ServerSentEvent(event="status", data={"run_id": run_id, "status": status.value})
        for event in batch:
            cursor = event.id
            yield ServerSentEvent(event="log", id=str(event.id), data=event.model_dump(mode="json"))
        if len(batch) == batch_size:
            continue  # more are waiting; drain before sleeping
        if status.terminal:
            yield ServerSentEvent(event="end", data={"run_id": run_id, "status": status.value})
            return
        if time.monotonic() >= deadline or await request.is_disconnected():
            return
        await anyio.sleep(settings.sse_poll_s)
