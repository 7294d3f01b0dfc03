"""What a worker reports about one of a run's engine processes: the row is written and the run's
lifecycle settles in the same transaction. Its own module, above both `runs` (the state machine)
and `lifecycle` (what processes mean for the run), so neither of those imports the other's caller."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from server.models import Host, HostProcessStatus, RunHost, utcnow
from server.schemas import RunHostUpsert
from server.services import events, lifecycle
from server.services import runs as run_service


def upsert_host_process(session: Session, run_id: int, process_index: int, report: RunHostUpsert) -> RunHost:
    """Create or update one host process row, then let the lifecycle settle the run (one transaction).

    The run row is locked first, so reports from the hosts of one run apply one at a time and each sees
    the others' effect (e.g. the last of N processes to exit is the one that ends the run).
    """
    run = run_service.get_for_update(session, run_id)
    attempt = run.attempt if report.attempt is None else report.attempt
    row = session.scalar(select(RunHost).where(
        RunHost.run_id == run_id, RunHost.attempt == attempt, RunHost.process_index == process_index))
    if row is None:
        row = RunHost(run_id=run_id, attempt=attempt, process_index=process_index)
        session.add(row)
    if report.pid is not None or report.address is not None:
        # The host took up its start message: whatever benched it for unanswered starts is over.
        session.execute(update(Host).where(Host.name == report.host_name, Host.start_failures > 0)
                        .values(start_failures=0, not_before=None))
    fields = report.model_dump(exclude={"attempt", "reason"}, exclude_unset=True)
    changed = any(getattr(row, name, None) != value for name, value in fields.items())
    for name, value in fields.items():
        setattr(row, name, value)
    row.updated_at = utcnow()
    session.flush()
    if changed and report.reason:
        level = "error" if report.status in (HostProcessStatus.FAILED, HostProcessStatus.LOST) else "info"
        events.record(session, run_id, f"{lifecycle.describe(row)} (attempt {attempt}) "
                                       f"{row.status.value.lower()}: {report.reason}", level=level,
                      source=f"host{process_index}")
    if changed:
        lifecycle.settle(session, run, source=f"host{process_index}")
    session.commit()
    return row
