"""The gang scheduler and the reconciler: database logic only; `server.scheduler` runs them in a loop
and sends the start messages they return.

Gang reservation: a run's hosts are reserved in one transaction, all or none. On PostgreSQL the
candidate rows are locked with `FOR UPDATE SKIP LOCKED`, so two schedulers (two API replicas) never
reserve the same host and never wait on each other; SQLite serialises writers anyway. Runs are taken
oldest first with bounded backfill (see `schedule_queued`): a run that cannot get its hosts does not
block younger runs that fit, and after `backfill_wait_s` it holds hosts as they free, so it is not
starved either.

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

import logging
import secrets
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from locojax.contract import StartHostMessage, run_dir_name
from locojax.modes import ProcessLayout, mode_for
from locojax.spec import PlacementSpec
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
from server.services import calibration, events, lifecycle
from server.services import runs as run_service
from server.settings import Settings

S = RunStatus
P = HostProcessStatus
log = logging.getLogger("locojax.scheduler")


StartMessage = StartHostMessage  # the contract's shape of one `start_host` task


def output_dir(run: Run, settings: Settings) -> str:
    """Where the run's host processes write: always `runs_root/<id>-<name>`, one directory per run id
    (two runs may share a name; specs may not choose a directory, see runs.check_paths)."""
    return str(Path(settings.runs_root) / run_dir_name(run.id, run.name))


def run_layout(run: Run) -> ProcessLayout:
    """The hosts a run reserves and the engine processes it starts on them, as its mode defines
    (CO: one process per host; SC: a controller plus a worker per host; DA and SFT: one controller on
    the first reserved host)."""
    # The spec was validated when the run was created; the row's columns are what the run was given.
    placement = PlacementSpec.model_construct(**{**run.spec.get("placement", {}), "mode": run.mode,
                                                 "hosts": run.hosts_needed})
    return mode_for(run.spec.get("kind", "grpo"), run.mode).layout(placement)


def _lock(query: Any, session: Session) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        return query.with_for_update(skip_locked=True)
    return query  # SQLite: the write session's BEGIN IMMEDIATE already serialises writers


def _serving(now: datetime) -> Any:
    """Not benched for leaving start messages unanswered (see Host.not_before)."""
    return or_(Host.not_before.is_(None), Host.not_before <= now)


def _free_hosts(session: Session, settings: Settings, now: datetime, limit: int, exclude: set[str]) -> list[Host]:
    query = select(Host).where(
        Host.reserved_by_run_id.is_(None), Host.status == HostRecordStatus.ONLINE,
        Host.last_heartbeat >= now - timedelta(seconds=settings.host_stale_s), _serving(now),
    )
    if exclude:
        query = query.where(Host.name.not_in(exclude))
    return list(session.scalars(_lock(query.order_by(Host.name).limit(limit), session)))


def _start_attempt(session: Session, run: Run, hosts: list[Host], settings: Settings, now: datetime,
                   *, resume: bool) -> list[StartMessage]:
    layout = run_layout(run)
    directory = output_dir(run, settings)
    run.attempt_secret = secrets.token_hex(32)  # a new attempt's processes never accept an old one's
    calibration.predict_run(session, run, hosts)  # the hosts' hardware profile prices the run
    messages = []
    for index, role in enumerate(layout.roles):
        host = hosts[layout.host_of[index]]
        session.add(RunHost(run_id=run.id, attempt=run.attempt, process_index=index, host_name=host.name,
                            role=HostRole(role), status=P.STARTING, updated_at=now))
        messages.append(StartMessage(host.name, run.id, run.attempt, index, len(layout.roles), role, resume,
                                     directory, run.attempt_secret))
    run.dispatched_at = now
    return messages


def _resume_flag(run: Run) -> bool:
    # Any earlier attempt may have left a checkpoint; the engine starts fresh when there is none.
    return run.attempt > 0 or run.last_checkpoint_step is not None


def usable_host_count(session: Session, settings: Settings, now: datetime) -> int:
    """Hosts that could ever serve a run now: online with a fresh heartbeat, reserved or not."""
    return session.scalar(select(func.count()).select_from(Host).where(
        Host.status == HostRecordStatus.ONLINE, Host.last_heartbeat >= now - timedelta(seconds=settings.host_stale_s),
        _serving(now)))


def _queued_wait_s(run: Run, now: datetime) -> float:
    return (now - (run.queued_since or run.created_at)).total_seconds()


def _note_waiting(session: Session, run: Run, reason: str) -> None:
    """Show why a QUEUED run waits (status_reason), written only when it changes."""
    if run.status_reason != reason:
        run.status_reason = reason


def schedule_queued(session: Session, settings: Settings, now: datetime | None = None) -> list[StartMessage]:
    """Reserve hosts for QUEUED runs, oldest first, all of a run's hosts or none. One commit per run.

    Admission that cannot be wedged (Kueue's BestEffortFIFO):
      * a run needing more hosts than are usable at all waits with that reason and blocks nobody;
      * a run that fits but finds too few free hosts does not stop younger runs that fit from starting
        (backfill) until it has waited `backfill_wait_s`; from then on it is the head: it holds every
        host that frees until it has all it needs, so it cannot be starved. One head at a time;
      * a failure while starting one run is recorded on that run (backoff, event) and the others go on.
    """
    now = now or utcnow()
    messages: list[StartMessage] = []
    run_ids = list(session.scalars(select(Run.id).where(
        Run.status == S.QUEUED, or_(Run.not_before.is_(None), Run.not_before <= now)).order_by(Run.id)))
    capacity = usable_host_count(session, settings, now)
    session.rollback()
    head: int | None = None
    for run_id in run_ids:
        try:
            started, holding = _admit(session, settings, run_id, now, capacity, head_chosen=head is not None)
            messages.extend(started)
            if holding:
                head = run_id
        except Exception as exc:  # noqa: BLE001 - one run's failure must not stop the others' starts
            session.rollback()
            _record_start_failure(session, settings, run_id, exc, now)
    return messages


def _admit(session: Session, settings: Settings, run_id: int, now: datetime, capacity: int, *,
           head_chosen: bool) -> tuple[list[StartMessage], bool]:
    """Try to start one QUEUED run; returns (start messages, whether it now holds hosts as the head)."""
    run = session.scalar(_lock(select(Run).where(Run.id == run_id, Run.status == S.QUEUED), session))
    if run is None:
        session.rollback()
        return [], False
    needed = run_layout(run).hosts  # exactly what the mode's layout occupies
    fresh = now - timedelta(seconds=settings.host_stale_s)
    held = list(session.scalars(select(Host).where(Host.reserved_by_run_id == run.id).order_by(Host.name)))
    usable_held = [h for h in held if h.status == HostRecordStatus.ONLINE and h.last_heartbeat >= fresh]
    waited = _queued_wait_s(run, now)
    may_hold = not head_chosen and waited >= settings.backfill_wait_s and needed <= capacity
    if not may_hold:
        usable_held = []
    for host in held:
        if host not in usable_held:
            host.reserved_by_run_id = None
    if needed > capacity:
        _note_waiting(session, run, f"waiting for hosts: placement.hosts is {needed} but {capacity} usable "
                                    "host(s) are registered; younger runs that fit start meanwhile")
        session.commit()
        return [], False
    missing = needed - len(usable_held)
    free = _free_hosts(session, settings, now, missing, exclude={h.name for h in held}) if missing > 0 else []
    if len(usable_held) + len(free) < needed:
        if may_hold:
            for host in free:
                host.reserved_by_run_id = run.id
            _note_waiting(session, run, f"holding {len(usable_held) + len(free)} of {needed} hosts as they "
                                        f"free (waited {waited:.0f} s); younger runs no longer start ahead of it")
        else:
            _note_waiting(session, run, f"waiting for {needed} free host(s); younger runs that fit may start "
                                        f"first for up to {settings.backfill_wait_s:g} s")
        session.commit()
        return [], may_hold
    hosts = usable_held + free
    for host in hosts:
        host.reserved_by_run_id = run.id
    started = _start_attempt(session, run, hosts, settings, now, resume=_resume_flag(run))
    run_service.transition(session, run, S.STARTING, source="scheduler",
                           reason=f"reserved {', '.join(h.name for h in hosts)} (attempt {run.attempt})")
    session.commit()
    return started, False


def _record_start_failure(session: Session, settings: Settings, run_id: int, exc: Exception, now: datetime) -> None:
    """Back a run off after its start failed (it stays QUEUED, its hosts released), with the cause as an event."""
    log.exception("starting run %s failed; the other runs go on", run_id)
    try:
        run = session.scalar(_lock(select(Run).where(Run.id == run_id, Run.status == S.QUEUED), session))
        if run is None:
            session.rollback()
            return
        session.execute(update(Host).where(Host.reserved_by_run_id == run.id).values(reserved_by_run_id=None))
        run.dispatch_failures += 1
        backoff = min(settings.requeue_backoff_max_s, settings.requeue_backoff_s * 2 ** (run.dispatch_failures - 1))
        run.not_before = now + timedelta(seconds=backoff)
        run.status_reason = f"start failed ({type(exc).__name__}); retrying in {backoff:g} s"
        events.record(session, run.id, f"start failed: {type(exc).__name__}: {str(exc)[:500]}; retrying in "
                                       f"{backoff:g} s", level="error", source="scheduler")
        session.commit()
    except Exception:  # noqa: BLE001 - recording the failure is best effort; the next tick tries again
        session.rollback()
        log.exception("could not record the start failure of run %s", run_id)


def check_starting(session: Session, settings: Settings, now: datetime | None = None) -> list[StartMessage]:
    """Requeue attempts that did not start in time; resend start messages nobody picked up."""
    now = now or utcnow()
    messages: list[StartMessage] = []
    runs = list(session.scalars(select(Run.id).where(Run.status == S.STARTING)))
    session.rollback()
    for run_id in runs:
        try:
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
                _bench_unresponsive_hosts(session, settings, waiting, now)
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
                                             row.role.value, resume, directory, run.attempt_secret or "")
                                for row in unclaimed)
                for row in unclaimed:
                    row.updated_at = now
                if unclaimed:
                    events.record(session, run.id, f"start message(s) not picked up after {age:.0f} s; sent again to "
                                                   f"{', '.join(row.host_name for row in unclaimed)}", source="scheduler",
                                  level="warning")
            session.commit()
        except (OperationalError, InterfaceError):
            raise
        except Exception:  # noqa: BLE001 - one run's bad state must not stop the others
            session.rollback()
            log.exception("check_starting: run %s failed; the other runs go on", run_id)
    return messages


def _bench_unresponsive_hosts(session: Session, settings: Settings, waiting: list[RunHost], now: datetime) -> None:
    """Hosts that never took up their start message (no pid, no address) by the start timeout are skipped
    for a doubling backoff: a fake worker (it registers and heartbeats, but consumes nothing) must not
    attract run after run. A host that answered but was slow (peers' fault) is not benched."""
    names = sorted({row.host_name for row in waiting if row.pid is None and row.address is None})
    for host in session.scalars(select(Host).where(Host.name.in_(names))):
        host.start_failures += 1
        backoff = min(settings.requeue_backoff_max_s * 10,
                      settings.start_timeout_s * 2 ** (host.start_failures - 1))
        host.not_before = now + timedelta(seconds=backoff)


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
        try:
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
            needed = run_layout(run).hosts
            missing = needed - len(usable)
            extra = _free_hosts(session, settings, now, missing, exclude={h.name for h in held}) if missing > 0 else []
            if len(usable) + len(extra) < needed:
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
        except (OperationalError, InterfaceError):
            raise
        except Exception:  # noqa: BLE001 - one run's bad state must not stop the others
            session.rollback()
            log.exception("check_recovering: run %s failed; the other runs go on", run_id)
    return messages


def tick(session: Session, settings: Settings, now: datetime | None = None,
         watching_since: datetime | None = None) -> list[StartMessage]:
    """One pass of the reconciler and the scheduler; returns the start messages to send.

    Each phase runs even when an earlier one failed (its error is logged; the next tick retries it): a
    bad row met by the reconciler must not keep queued runs from starting. A database that is down
    fails every phase, and that is raised for the loop to see."""
    messages: list[StartMessage] = []
    phases = [lambda: check_hosts(session, settings, now, watching_since) or [],
              lambda: check_recovering(session, settings, now),
              lambda: check_starting(session, settings, now),
              lambda: schedule_queued(session, settings, now)]
    for phase in phases:
        try:
            messages += phase()
        except (OperationalError, InterfaceError):
            session.rollback()
            raise  # the database is unreachable: the loop tracks that (see SchedulerLoop.tick)
        except Exception as exc:  # noqa: BLE001 - isolate phases; each is retried next tick
            session.rollback()
            log.exception("scheduler phase failed (%s); the others go on", type(exc).__name__)
    return messages

