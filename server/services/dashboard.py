"""The reads the dashboard (web/) needs that no other service offers: the web layer reads and writes
only through server/services, never the ORM directly (DESIGN §3)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import Host, PlacementDecision, Run, RunEvent, RunStatus


def hosts_named(session: Session, names: Iterable[str]) -> dict[str, Host]:
    """The inventory rows of these host names (those that exist), by name."""
    names = set(names)
    if not names:
        return {}
    return {host.name: host for host in session.scalars(select(Host).where(Host.name.in_(names)))}


def events_tail(session: Session, run_id: int, limit: int) -> list[RunEvent]:
    """The run's newest `limit` events, oldest first."""
    rows = session.scalars(select(RunEvent).where(RunEvent.run_id == run_id).order_by(RunEvent.id.desc()).limit(limit))
    return list(reversed(list(rows)))


def find_run(session: Session, run_id: int) -> Run | None:
    return session.get(Run, run_id)


def run_status(session: Session, run_id: int) -> RunStatus | None:
    return session.scalar(select(Run.status).where(Run.id == run_id))


def find_decision(session: Session, decision_id: int) -> PlacementDecision | None:
    return session.get(PlacementDecision, decision_id)
