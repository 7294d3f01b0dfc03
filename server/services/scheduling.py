"""The gang scheduler and the reconciler: database logic only; `server.scheduler` runs them in a loop
and sends the start messages they return.

Gang reservation: a run's hosts are reserved in one transaction, all or none. On PostgreSQL the
candidate rows are locked with `FOR UPDATE SKIP LOCKED`, so two schedulers (two API replicas) never
reserve the same host and never wait on each other; SQLite serialises writers anyway. Runs are taken
first in, first out: when the oldest QUEUED run cannot get its hosts, younger runs wait behind it
rather than starve it.

Celery only delivers the start messages; nothing here trusts delivery. Every tick re-derives what
should happen from the tables:
  * a STARTING attempt whose processes have not all started within `start_timeout_s` loses its
    reservation and goes back to QUEUED with exponential backoff (a new attempt; late messages of the
    old one are stale); one whose messages went unanswered for `dispatch_resend_s` is sent again
    (start messages are idempotent per run, attempt and process);
  * a host whose heartbeat is older than `host_lost_s` is marked LOST, and so are the live processes
    it ran: their runs go RECOVERING (or FAILED when out of restarts) through the lifecycle; not
    before the reconciler has itself reached the database for `host_lost_s` (after a database or API
    outage every heartbeat is old, and that says nothing about the hosts);
  * a RECOVERING run is restarted, from its last checkpoint, once every process of the old attempt
    has ended, on its still-online hosts plus free ones replacing lost hosts.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from server.models import (
    Host,
    HostProcessStatus,
    HostRecordStatus,
    HostRole,
    Run,
    RunHost,
    RunStatus,
    utcnow,
)
from server.services import events, lifecycle
from server.services import runs as run_service
from server.settings import Settings

S = RunStatus
P = HostProcessStatus


@dataclasses.dataclass(frozen=True)
class StartMessage:
    """One `start_host` task for one host's queue. The worker re-reads the run from the API (tasks take
    ids); the message carries only what the scheduler decided."""

    host_name: str
    run_id: int
    attempt: int
    process_index: int
    num_processes: int
    role: str
    resume: bool
    output_dir: str

    def task_kwargs(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if key != "host_name"}


def output_dir(run: Run, settings: Settings) -> str:
    """Where the run's host processes write: the spec's `output_dir`, else one directory per run id
    (two runs may share a name)."""
    return run.spec.get("output_dir") or str(Path(settings.runs_root) / f"{run.id}-{run.name}")


def process_layout(run: Run) -> list[HostRole]:
    """CO runs one engine process per host. SC is one controller owning every device; DA's driver
    places its actors through Ray; SFT is one process: each is started on the first reserved host."""
    if run.mode == "co" and run.spec.get("kind", "grpo") == "grpo":
        return [HostRole.CO] * run.hosts_needed
    return [HostRole.CONTROLLER]


def _lock(query: Any, session: Session) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        return query.with_for_update(skip_locked=True)
    return query  # SQLite: the write session's BEGIN IMMEDIATE already serialises writers


def _free_hosts(session: Session, settings: Settings, now: datetime, limit: int, exclude: set[str]) -> list[Host]:
    query = select(Host).where(
        Host.reserved_by_run_id.is_(None), Host.status == HostRecordStatus.ONLINE,
        Host.last_heartbeat >= now - timedelta(seconds=settings.host_stale_s),
    )
    if exclude:
        query = query.where(Host.name.not_in(exclude))
    return list(session.scalars(_lock(query.order_by(Host.name).limit(limit), session)))


def _start_attempt(session: Session, run: Run, hosts: list[Host], settings: Settings, now: datetime,
                   *, resume: bool) -> list[StartMessage]:
    roles = process_layout(run)
    directory = output_dir(run, settings)
    messages = []
    for index, role in enumerate(roles):
        session.add(RunHost(run_id=run.id, attempt=run.attempt, process_index=index, host_name=hosts[index].name,
                            role=role, status=P.STARTING, updated_at=now))
        messages.append(StartMessage(hosts[index].name, run.id, run.attempt, index, len(roles), role.value, resume,
                                     directory))
    run.dispatched_at = now
    return messages


def _resume_flag(run: Run) -> bool:
    # Any earlier attempt may have left a checkpoint; the engine starts fresh when there is none.
    return run.attempt > 0 or run.last_checkpoint_step is not None


def schedule_queued(session: Session, settings: Settings, now: datetime | None = None) -> list[StartMessage]:
    """Reserve hosts for QUEUED runs, oldest first, all of a run's hosts or none. One commit per run."""
    now = now or utcnow()
    messages: list[StartMessage] = []
    while True:
        run = session.scalar(_lock(
            select(Run).where(Run.status == S.QUEUED, or_(Run.not_before.is_(None), Run.not_before <= now))
            .order_by(Run.id).limit(1), session))
        if run is None:
            session.rollback()
            return messages
        hosts = _free_hosts(session, settings, now, run.hosts_needed, exclude=set())
        if len(hosts) < run.hosts_needed:
            session.rollback()  # reserve nothing; FIFO: younger runs wait behind this one
            return messages
        for host in hosts:
            host.reserved_by_run_id = run.id
        started = _start_attempt(session, run, hosts, settings, now, resume=_resume_flag(run))
        run_service.transition(session, run, S.STARTING, source="scheduler",
                               reason=f"reserved {', '.join(h.name for h in hosts)} (attempt {run.attempt})")
        session.commit()
        messages.extend(started)


def check_starting(session: Session, settings: Settings, now: datetime | None = None) -> list[StartMessage]:
    """Requeue attempts that did not start in time; resend start messages nobody picked up."""
    now = now or utcnow()
    messages: list[StartMessage] = []
    runs = list(session.scalars(select(Run.id).where(Run.status == S.STARTING)))
    session.rollback()
    for run_id in runs:
        run = session.scalar(_lock(select(Run).where(Run.id == run_id, Run.status == S.STARTING), session))
        if run is None or run.dispatched_at is None:
            session.rollback()
            continue
        waiting = [row for row in lifecycle.processes(session, run, run.attempt) if row.status is P.STARTING]
        age = (now - run.dispatched_at).total_seconds()
        if waiting and age >= settings.start_timeout_s:
            for row in waiting:
                row.status, row.ended_at, row.updated_at = P.KILLED, now, now
            session.execute(update(Host).where(Host.reserved_by_run_id == run.id).values(reserved_by_run_id=None))
            run.dispatch_failures += 1
            backoff = min(settings.requeue_backoff_max_s, settings.requeue_backoff_s * 2 ** (run.dispatch_failures - 1))
            run.not_before = now + timedelta(seconds=backoff)
            names = ", ".join(f"{row.host_name} (process {row.process_index})" for row in waiting)
            run_service.transition(session, run, S.QUEUED, source="scheduler",
                                   reason=f"{names} did not start within {settings.start_timeout_s:g} s; hosts "
                                          f"released, retrying in {backoff:g} s")
        elif waiting:
            # A row's updated_at is when its message was last sent (or when its worker last reported).
            unclaimed = [row for row in waiting if row.pid is None and row.address is None
                         and (now - row.updated_at).total_seconds() >= settings.dispatch_resend_s]
            resume = _resume_flag(run)
            directory = output_dir(run, settings)
            count = len(lifecycle.processes(session, run, run.attempt))
            messages.extend(StartMessage(row.host_name, run.id, run.attempt, row.process_index, count,
                                         row.role.value, resume, directory) for row in unclaimed)
            for row in unclaimed:
                row.updated_at = now
            if unclaimed:
                events.record(session, run.id, f"start message(s) not picked up after {age:.0f} s; sent again to "
                                               f"{', '.join(row.host_name for row in unclaimed)}", source="scheduler",
                              level="warning")
        session.commit()
    return messages


def check_hosts(session: Session, settings: Settings, now: datetime | None = None,
                watching_since: datetime | None = None) -> None:
    """Mark hosts with stale heartbeats LOST, and the live processes they ran with them.

    `watching_since`: since when the caller has reached the database without a break. Heartbeats cannot
    land while the database (or the API) is down, so after such an outage every host looks silent;
    nobody is declared lost until the reconciler has itself watched for `host_lost_s`.
    """
    now = now or utcnow()
    if watching_since is not None and (now - watching_since).total_seconds() < settings.host_lost_s:
        return
    cutoff = now - timedelta(seconds=settings.host_lost_s)
    lost = list(session.scalars(_lock(select(Host).where(Host.status == HostRecordStatus.ONLINE,
                                                         Host.last_heartbeat < cutoff), session)))
    for host in lost:
        host.status = HostRecordStatus.LOST
    session.commit()
    for host in lost:
        lifecycle.lose_processes_on(session, host.name, f"no heartbeat for {settings.host_lost_s:g} s",
                                    source="reconciler", now=now)
        session.commit()


def check_recovering(session: Session, settings: Settings, now: datetime | None = None) -> list[StartMessage]:
    """Restart RECOVERING runs once the old attempt's processes are gone; settle CANCELLING runs whose
    processes never started."""
    now = now or utcnow()
    messages: list[StartMessage] = []
    runs = list(session.scalars(select(Run.id).where(Run.status.in_([S.RECOVERING, S.CANCELLING]))))
    session.rollback()
    for run_id in runs:
        run = session.scalar(_lock(select(Run).where(Run.id == run_id), session))
        if run is None:
            session.rollback()
            continue
        old = [row for row in lifecycle.processes(session, run) if row.status in lifecycle.ALIVE_PROCESS_STATES]
        waited = (now - run.updated_at).total_seconds()  # since the run became RECOVERING or CANCELLING
        for row in old:
            # A process that never started (no pid) has nothing to wait for; a live one of an old attempt
            # is stopped by its worker, which sees the run move on; give it `kill_timeout_s`, then
            # consider its worker gone with it.
            if row.pid is None or waited >= settings.kill_timeout_s:
                row.status, row.ended_at, row.updated_at = (P.KILLED if row.pid is None else P.LOST), now, now
        if RunStatus(run.status) is S.CANCELLING:
            lifecycle.settle(session, run, source="scheduler")
            session.commit()
            continue
        if any(row.status in lifecycle.ALIVE_PROCESS_STATES for row in old):
            session.commit()
            continue
        held = list(session.scalars(select(Host).where(Host.reserved_by_run_id == run.id).order_by(Host.name)))
        fresh = now - timedelta(seconds=settings.host_stale_s)
        usable = [h for h in held if h.status == HostRecordStatus.ONLINE and h.last_heartbeat >= fresh]
        for host in held:
            if host not in usable:
                host.reserved_by_run_id = None
        missing = run.hosts_needed - len(usable)
        extra = _free_hosts(session, settings, now, missing, exclude={h.name for h in held}) if missing > 0 else []
        if len(usable) + len(extra) < run.hosts_needed:
            session.commit()  # keep what we hold; try again next tick
            continue
        for host in extra:
            host.reserved_by_run_id = run.id
        hosts = usable + extra
        messages.extend(_start_attempt(session, run, hosts, settings, now, resume=True))
        origin = (f"the checkpoint at step {run.last_checkpoint_step}" if run.last_checkpoint_step is not None
                  else "the start (no checkpoint yet)")
        run_service.transition(session, run, S.STARTING, source="scheduler",
                               reason=f"restarting attempt {run.attempt} on {', '.join(h.name for h in hosts)} "
                                      f"from {origin}")
        session.commit()
    return messages


def tick(session: Session, settings: Settings, now: datetime | None = None,
         watching_since: datetime | None = None) -> list[StartMessage]:
    """One pass of the reconciler and the scheduler; returns the start messages to send."""
    check_hosts(session, settings, now, watching_since)
    messages = check_recovering(session, settings, now)
    messages += check_starting(session, settings, now)
    messages += schedule_queued(session, settings, now)
    return messages

