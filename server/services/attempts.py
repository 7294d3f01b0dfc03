"""What a worker may report about a run, and for which attempt (issue 17).

Every report a worker sends about a run (metric batches, events, checkpoints, its processes' rows)
names the attempt it belongs to. A report of an attempt that is no longer the run's current one, or
about a run that has finished, is refused with 409 (STALE_ATTEMPT / RUN_FINISHED): a relay of a
killed attempt must not overwrite the steps the new attempt writes, and it stops when it sees the 409.
Reports are also tied to hosts: a worker token speaks only for process rows that the scheduler placed,
in the current attempt, on a host the token is bound to (`services.authorization`).

The one exception is a process row of an older attempt recording that its process ended: that is
news about a process, not about the run (the lifecycle ignores old attempts), and it lets the
scheduler restart a group without waiting out `kill_timeout_s` for a process already gone.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from locojax.contract import METRICS_PROCESS_INDEX
from server.errors import ConflictError, ForbiddenError
from server.models import ENDED_PROCESS_STATES, ApiToken, HostProcessStatus, Run, RunHost, RunStatus
from server.services import authorization


def check_current(run: Run, attempt: int, what: str) -> None:
    """409 unless `attempt` is the run's current attempt and the run has not finished."""
    if attempt != run.attempt:
        raise ConflictError(f"{what} for attempt {attempt} of run {run.id}, whose current attempt is {run.attempt}; "
                            "stale reports are refused", code="STALE_ATTEMPT",
                            details={"run_id": run.id, "attempt": attempt, "current_attempt": run.attempt})
    if RunStatus(run.status).terminal:
        raise ConflictError(f"{what} for run {run.id}, which is {run.status.value}; a finished run takes no reports",
                            code="RUN_FINISHED", details={"run_id": run.id, "status": run.status.value})


def placed_processes(session: Session, run: Run, token: ApiToken, attempt: int) -> list[RunHost]:
    """The current attempt's process rows that `token` may speak for (all of them for an admin)."""
    rows = session.scalars(select(RunHost).where(RunHost.run_id == run.id, RunHost.attempt == attempt)
                           .order_by(RunHost.process_index))
    return [row for row in rows if authorization.may_act_as_host(token, row.host_name)]


def reporting_process(session: Session, run: Run, token: ApiToken, attempt: int, what: str,
                      host_name: str | None = None) -> RunHost | None:
    """Check that `token` reports `what` for a current-attempt process of `run` (on `host_name`, when
    given); returns that process row, the lowest-indexed one the token may speak for (None for an admin
    speaking for no host). 409 or 403 otherwise."""
    check_current(run, attempt, what)
    if host_name is not None:
        authorization.check_host(token, host_name)
    mine = [row for row in placed_processes(session, run, token, attempt)
            if host_name is None or row.host_name == host_name]
    if mine:
        return mine[0]
    if authorization.is_admin(token):
        return None
    raise ForbiddenError(f"{what}: run {run.id} attempt {attempt} has no process on "
                         f"{host_name or 'a host this token is bound to'}", code="HOST_NOT_PLACED",
                         details={"run_id": run.id, "attempt": attempt, "host": host_name or token.hosts})


def check_metrics_process(run: Run, process: RunHost | None, what: str = "metrics") -> None:
    """403 NOT_METRICS_PROCESS unless the report comes from the process that writes metrics.jsonl (every
    host's rows and the aggregate) and reports the run's checkpoints: another host of the run has
    neither to relay, so a report from it, for any host index or step, would be forged. An admin
    speaking for no host (`process` None) may."""
    if process is None or process.process_index == METRICS_PROCESS_INDEX:
        return
    raise ForbiddenError(f"{what}: only process {METRICS_PROCESS_INDEX} of run {run.id} (the one that writes "
                         f"metrics.jsonl and reports checkpoints) reports {what}; host {process.host_name} runs "
                         f"process {process.process_index}", code="NOT_METRICS_PROCESS",
                         details={"run_id": run.id, "attempt": process.attempt, "host": process.host_name,
                                  "process_index": process.process_index,
                                  "metrics_process_index": METRICS_PROCESS_INDEX})


def check_process_report(session: Session, run: Run, token: ApiToken, process_index: int, attempt: int,
                         host_name: str, status: HostProcessStatus) -> None:
    """A worker's report about one process row: the row must exist (the scheduler creates rows, workers
    only update them), be placed on `host_name`, which the token is bound to, and belong to the current
    attempt of an unfinished run; an older attempt's row may only be told that its process ended."""
    authorization.check_host(token, host_name)
    row = session.scalar(select(RunHost).where(RunHost.run_id == run.id, RunHost.attempt == attempt,
                                               RunHost.process_index == process_index))
    if row is None:
        raise ConflictError(f"run {run.id} attempt {attempt} has no process {process_index}; only the scheduler "
                            "places processes", code="PROCESS_NOT_PLACED",
                            details={"run_id": run.id, "attempt": attempt, "process_index": process_index})
    if row.host_name != host_name:
        raise ForbiddenError(f"process {process_index} of run {run.id} attempt {attempt} is placed on "
                             f"{row.host_name}, not {host_name}", code="HOST_NOT_PLACED",
                             details={"run_id": run.id, "process_index": process_index, "host": row.host_name})
    if attempt < run.attempt and status in ENDED_PROCESS_STATES:
        return  # an old attempt's process ended: recorded, the run does not follow it
    check_current(run, attempt, f"process {process_index} report")
