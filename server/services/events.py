"""Run events: the log lines of a run (from the server itself and from workers and host processes)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from server.models import RunEvent, utcnow
from server.schemas import EventCreate


def record(session: Session, run_id: int, message: str, *, level: str = "info", source: str = "server",
           ts: datetime | None = None) -> None:
    """Add a server-side event to the current unit of work (committed by the caller)."""
    session.add(RunEvent(run_id=run_id, message=message, level=level, source=source, ts=ts or utcnow()))


def append(session: Session, run_id: int, events: Sequence[EventCreate], *, source: str) -> int:
    """Store a batch of worker events in one transaction; repeated (source, seq) pairs are skipped.

    `source` (who reported them) and the timestamp are the server's, never the reporter's. Returns how
    many were new. Retried batches carry the same seq numbers, so a retry after a lost response stores
    nothing twice.
    """
    now = utcnow()
    rows: list[dict] = []
    seen: set[tuple[str, int]] = set()
    for event in events:
        if event.seq is not None:
            if (source, event.seq) in seen:
                continue
            seen.add((source, event.seq))
        rows.append({"run_id": run_id, "ts": now, "level": event.level, "source": source,
                     "message": event.message, "seq": event.seq})
    if seen:
        sources = {source for source, _ in seen}
        stored = set(session.execute(
            select(RunEvent.source, RunEvent.seq).where(
                RunEvent.run_id == run_id, RunEvent.source.in_(sources),
                RunEvent.seq.in_([seq for _, seq in seen]))
        ).tuples())
        rows = [row for row in rows if row["seq"] is None or (row["source"], row["seq"]) not in stored]
    if rows:
        dialect = session.get_bind().dialect.name
        module = postgresql if dialect == "postgresql" else sqlite
        # The pre-check makes the count right; ON CONFLICT keeps a concurrent duplicate from failing the batch.
        statement = module.insert(RunEvent).on_conflict_do_nothing(index_elements=["run_id", "source", "seq"])
        session.execute(statement, rows)
    session.commit()
    return len(rows)


def list_after(session: Session, run_id: int, after: int, limit: int, level: str | None = None) -> list[RunEvent]:
    query = select(RunEvent).where(RunEvent.run_id == run_id, RunEvent.id > after)
    if level is not None:
        query = query.where(RunEvent.level == level)
    return list(session.scalars(query.order_by(RunEvent.id).limit(limit)))
