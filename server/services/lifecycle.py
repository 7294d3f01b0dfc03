"""What a run's host processes say about the run: the one place that derives run transitions from them.

Workers report each engine host process (STARTING, RUNNING, then EXITED / FAILED / KILLED; the
reconciler adds LOST). After every such report `settle()` looks at the run's processes and moves the
run along (through `runs.transition`, the one function that changes a run's status):

  STARTING  -> RUNNING     every process of the attempt has started
  RUNNING   -> SUCCEEDED   every process exited with code 0
  RUNNING   -> RECOVERING  a process failed or was lost, and restarts are left (else -> FAILED)
  CANCELLING-> CANCELLED   no process of the run is alive any more

A process that ends with `EXIT_CANCELLED` stopped cooperatively at a step boundary (the engine saw the
cancel flag); that ends the run CANCELLED, never FAILED.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from locojax.contract import EXIT_CANCELLED  # what `locojax host`/`train` exit with after a cooperative cancel
from server.models import ENDED_PROCESS_STATES, HostProcessStatus, Run, RunHost, RunStatus, utcnow
from server.services import events
from server.services import runs as run_service

S = RunStatus
P = HostProcessStatus

ALIVE_PROCESS_STATES = frozenset({P.STARTING, P.RUNNING})


def processes(session: Session, run: Run, attempt: int | None = None) -> list[RunHost]:
    query = select(RunHost).where(RunHost.run_id == run.id)
    if attempt is not None:
        query = query.where(RunHost.attempt == attempt)
    return list(session.scalars(query.order_by(RunHost.attempt, RunHost.process_index)))


def describe(row: RunHost) -> str:
    return f"host process {row.process_index} on {row.host_name}"


def settle(session: Session, run: Run, *, source: str = "server") -> None:
    """Apply what the processes imply for `run` (locked by the caller); the caller commits."""
    status = RunStatus(run.status)
    if status in (S.QUEUED, S.RECOVERING) or status.terminal:
        return  # QUEUED: nothing runs; RECOVERING: the scheduler restarts the group; terminal: final
    everything = processes(session, run)
    if status is S.CANCELLING:
        if not any(row.status in ALIVE_PROCESS_STATES for row in everything):
            run_service.transition(session, run, S.CANCELLED, reason=run.status_reason or "cancelled", source=source)
        return

    current = [row for row in everything if row.attempt == run.attempt]
    if not current:
        return
    broken = [row for row in current if row.status in (P.FAILED, P.LOST)
              or (row.status is P.KILLED and row.exit_code != EXIT_CANCELLED)]
    if broken:
        row = broken[0]
        what = f"{describe(row)} {row.status.value.lower()}" + (f" (exit code {row.exit_code})"
                                                                if row.exit_code is not None else "")
        if run.restarts < run.max_restarts:
            run_service.transition(session, run, S.RECOVERING, source=source,
                                   reason=f"{what}; restarting all {len(current)} host process(es) from the "
                                          f"last checkpoint (restart {run.restarts + 1} of {run.max_restarts})")
        else:
            restarts = f" after {run.restarts} restart(s)" if run.restarts else ""
            run_service.transition(session, run, S.FAILED, reason=f"{what}{restarts}", source=source)
        return

    if status is S.STARTING and all(row.status is not P.STARTING for row in current):
        run_service.transition(session, run, S.RUNNING, reason=f"all {len(current)} host process(es) started",
                               source=source)
        status = S.RUNNING
    if all(row.status in ENDED_PROCESS_STATES for row in current):
        if any(row.exit_code == EXIT_CANCELLED for row in current):
            # The engine stopped at a step boundary on a cancel request that raced this report.
            run_service.transition(session, run, S.CANCELLING, reason="the engine stopped on a cancel request",
                                   source=source)
            run_service.transition(session, run, S.CANCELLED, reason="cancelled at a step boundary", source=source)
        else:
            run_service.transition(session, run, S.SUCCEEDED,
                                   reason=f"all {len(current)} host process(es) exited cleanly", source=source)


def lose_processes_on(session: Session, host_name: str, why: str, *, source: str, claimed_only: bool = False,
                      now: datetime | None = None) -> list[int]:
    """Mark the live processes that `host_name` ran LOST (the host, or its worker, is gone) and settle
    their runs; returns the run ids. Each run is locked before its rows change; the caller commits.

    `claimed_only`: only processes a worker had taken up (pid or coordinator address reported); a start
    message nobody took is sent again by the scheduler instead.
    """
    now = now or utcnow()
    rows = list(session.scalars(select(RunHost).where(
        RunHost.host_name == host_name, RunHost.status.in_(ALIVE_PROCESS_STATES))))
    if claimed_only:
        rows = [row for row in rows if row.pid is not None or row.address is not None]
    run_ids = sorted({row.run_id for row in rows})
    for run_id in run_ids:
        run = run_service.get_for_update(session, run_id)
        for row in rows:
            if row.run_id == run_id:
                row.status, row.ended_at, row.updated_at = P.LOST, now, now
        events.record(session, run_id, f"host {host_name} lost: {why}", level="error", source=source)
        settle(session, run, source=source)
    return run_ids
