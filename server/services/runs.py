"""Runs: submission, the lifecycle state machine, and what workers report about a run.

Every status change of a run goes through `transition()`. It checks the edge against `TRANSITIONS`,
raises `IllegalTransitionError` before writing anything, and otherwise writes the change with a
conditional UPDATE (`WHERE status = <the status we read>`), so two writers racing on one run cannot
both win: the loser gets a 409 and nothing of its change is written. RECOVERING is refused once a run
has used `max_restarts` automatic restarts (409 RESTARTS_EXHAUSTED): the caller fails the run instead.

Terminal states (SUCCEEDED, FAILED, CANCELLED) have no lifecycle exits. The one way out is a user's
explicit `resume`, allowed from FAILED and CANCELLED only: it reopens the run as a new attempt that
continues from its last checkpoint under the same id, so its metrics and events stay one history.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping
from pathlib import Path

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from locojax.contract import CONTROL_DIR, EXPORT_DIR, TIME_STEP
from locojax.spec import RunSpec
from server.errors import ConflictError, IllegalTransitionError, InvalidInputError, NotFoundError
from server.models import (
    AGGREGATE_HOST,
    TERMINAL_STATES,
    CalibrationObservation,
    Host,
    PlacementDecision,
    Run,
    RunEvent,
    RunHost,
    RunStatus,
    StepMetric,
    StepMetricRollup,
    StepMetricSeries,
    utcnow,
)
from server.services import calibration, events
from server.services import pagination
from server.settings import Settings

S = RunStatus

# The lifecycle (DESIGN §7). QUEUED -> STARTING when the scheduler has reserved every host (gang);
# STARTING -> QUEUED when not all hosts started in time and the reservation was released;
# RECOVERING while the whole host group restarts from the last checkpoint after a host was lost.
TRANSITIONS: Mapping[RunStatus, frozenset[RunStatus]] = {
    S.QUEUED: frozenset({S.STARTING, S.CANCELLED, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.QUEUED, S.RECOVERING, S.CANCELLING, S.FAILED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLING, S.RECOVERING}),
    S.RECOVERING: frozenset({S.STARTING, S.QUEUED, S.CANCELLING, S.CANCELLED, S.FAILED}),
    # A run may finish its last step (or crash) while the cancel is on its way.
    S.CANCELLING: frozenset({S.CANCELLED, S.SUCCEEDED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
RESUMABLE = frozenset({S.FAILED, S.CANCELLED})

# DESIGN §6: the per-step wall time; its median over a finished run is the measured step time.
STEP_TIME_KEY = TIME_STEP


def transition(session: Session, run: Run, to: RunStatus, *, reason: str | None = None, source: str = "server",
               reopen: bool = False) -> Run:
    """Move `run` to `to`, or raise without writing. The caller commits.

    `reopen=True` is the resume path: the only edge out of a terminal state (FAILED/CANCELLED -> QUEUED).
    """
    current = RunStatus(run.status)
    if reopen:
        legal = current in RESUMABLE and to is S.QUEUED
        allowed = [S.QUEUED.value] if current in RESUMABLE else []
    else:
        legal = to in TRANSITIONS[current]
        allowed = sorted(state.value for state in TRANSITIONS[current])
    if not legal:
        raise IllegalTransitionError(run.id, current.value, to.value, allowed)
    if to is S.RECOVERING and run.restarts >= run.max_restarts:
        raise ConflictError(f"run {run.id} has used all {run.max_restarts} restart(s); it can only fail now",
                            code="RESTARTS_EXHAUSTED", details={"run_id": run.id, "restarts": run.restarts,
                                                                "max_restarts": run.max_restarts})

    now = utcnow()
    values: dict[str, object] = {"status": to, "status_reason": reason, "updated_at": now}
    if to is S.RUNNING and run.started_at is None:
        values["started_at"] = now
    if to is S.QUEUED:
        values["queued_since"] = now  # the scheduler's bounded backfill wait counts from here
    if to is S.CANCELLING:
        values["cancel_requested"] = True
    if to is S.RECOVERING:
        values["restarts"] = run.restarts + 1
        values["attempt"] = run.attempt + 1
    if to is S.QUEUED and current is S.STARTING:
        # The host group did not start in time and is requeued: a new attempt, so a start message of
        # the old one that arrives late is recognised as stale by the worker.
        values["attempt"] = run.attempt + 1
    if reopen:
        # A resume is a fresh attempt with a fresh restart budget, continuing from the last checkpoint.
        values.update(attempt=run.attempt + 1, restarts=0, cancel_requested=False, finished_at=None)
    if to in TERMINAL_STATES:
        values["finished_at"] = now
        values["measured_step_s"] = _median_step_time(session, run.id)
        values["attempt_secret"] = None  # no process of the run may authenticate any more

    result = session.execute(
        update(Run).where(Run.id == run.id, Run.status == current).values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # someone else changed the run since we read it; this UPDATE wrote nothing
        raise ConflictError(f"run {run.id} changed state concurrently; read it again",
                            code="RUN_STATE_CHANGED", details={"run_id": run.id, "expected": current.value})
    for name, value in values.items():
        set_committed_value(run, name, value)  # mirror the UPDATE without making the ORM write it again

    message = f"{current.value} -> {to.value}" + (f": {reason}" if reason else "")
    events.record(session, run.id, message, level="error" if to is S.FAILED else "info", source=source)
    if to in TERMINAL_STATES:
        # A finished run holds no hosts (the gang reservation ends with it).
        session.execute(update(Host).where(Host.reserved_by_run_id == run.id).values(reserved_by_run_id=None))
        if run.decision_id is not None and run.measured_step_s is not None:
            session.execute(update(PlacementDecision).where(PlacementDecision.id == run.decision_id).values(
                measured_step_s=run.measured_step_s, measured_at=now, measured_run_id=run.id))
        calibration.record_run(session, run)  # every finished run teaches the placement model
    return run


def _median_step_time(session: Session, run_id: int) -> float | None:
    values = list(session.scalars(select(StepMetric.value).where(
        StepMetric.run_id == run_id, StepMetric.key == STEP_TIME_KEY, StepMetric.host == AGGREGATE_HOST)))
    return statistics.median(values) if values else None


# --- submission -------------------------------------------------------------------------------------

def _inside(path: str, roots: list[Path]) -> bool:
    """Whether `path` (absolute) is inside one of `roots`, symlinks resolved where this server can see
    them (a link under a data root pointing elsewhere is outside). A path the server cannot see resolves
    lexically; the hosts read it under the same absolute name."""
    if "\x00" in path or not os.path.isabs(path):
        return False
    real = os.path.realpath(path)
    for root in roots:
        root_real = os.path.realpath(root)
        if os.path.commonpath([real, root_real]) == root_real:
            return True
    return False


def _readable(settings: Settings) -> str:
    """Where a spec may read, for the messages: the data roots, and runs' exported models."""
    return ", ".join([*(str(root) for root in settings.data_roots),
                      str(Path(settings.runs_root) / "<id>-<name>" / EXPORT_DIR)])


def _read_refusal(path: str, settings: Settings) -> str | None:
    """Why a spec may not read `path` (absolute), or None. Under `runs_root` only a run's exported model
    (`<runs_root>/<run dir>/model`, what a GRPO spec starts from after an SFT run) may be read: the rest of
    another tenant's run directory (checkpoints, metrics, and `.control/` with its start specs and
    attempt secrets) is not a spec's to read. That holds even where a data root contains `runs_root`."""
    if "\x00" in path:
        return f"path {path!r} contains a NUL byte"
    real = os.path.realpath(path)
    if CONTROL_DIR in Path(path).parts or CONTROL_DIR in Path(real).parts:
        return f"path {path!r} goes through a {CONTROL_DIR} directory, the workers' own files, which no spec may read"
    runs_real = os.path.realpath(settings.runs_root)
    if os.path.commonpath([real, runs_real]) == runs_real:
        inside_runs = Path(real).relative_to(runs_real).parts
        if len(inside_runs) >= 2 and inside_runs[1] == EXPORT_DIR:
            return None
        return (f"path {path!r} is in runs_root but not in a run's exported model "
                f"({Path(settings.runs_root) / '<id>-<name>' / EXPORT_DIR}), the only part of a run a spec may read")
    if _inside(path, settings.data_roots):
        return None
    return f"path {path!r} is outside the allowed roots ({_readable(settings)})"


def check_paths(spec: RunSpec, settings: Settings) -> None:
    """The server owns run directories: every run writes under `runs_root/<id>-<name>`, so a spec may not
    choose `output_dir` or `checkpoint.dir` (two runs sharing a directory overwrite each other's model
    and metrics). Read paths must be absolute (a relative one would mean the API's directory here and
    each host's there) and inside the data roots, or a run's exported model under `runs_root`."""
    errors = [{"field": field, "message": "the server chooses each run's directory (runs_root/<id>-<name>); "
                                          "leave it unset"}
              for field, value in (("spec.output_dir", spec.output_dir), ("spec.checkpoint.dir", spec.checkpoint.dir))
              if value is not None]
    reads = [
        ("spec.task.path", spec.task.path),
        ("spec.eval.path", spec.eval.path if spec.eval else None),
        ("spec.model.checkpoint", spec.model.checkpoint),
        ("spec.model.tokenizer", spec.model.tokenizer),
    ]
    for field, value in reads:
        if value is None:
            continue
        if not os.path.isabs(value):
            errors.append({"field": field, "message": f"path {value!r} is relative; give an absolute path under "
                                                      f"{_readable(settings)}"})
        elif (refusal := _read_refusal(value, settings)) is not None:
            errors.append({"field": field, "message": refusal})
    if errors:
        raise InvalidInputError(f"{errors[0]['field']}: {errors[0]['message']}", code="PATH_NOT_ALLOWED",
                                details=errors)


def check_names(spec: RunSpec, settings: Settings) -> None:
    """Task and reward names the hosts look up in their registries: a typo is a 422 now, not a run that
    fails on its hosts after its start-up. A `package.module:function` reward must be under one of the
    operator's module prefixes (`Settings.reward_modules`); the hosts check the same list again."""
    from locojax.rewards import unknown_names  # the registries: not paid for at the API's import

    errors = [{"field": f"spec.{field}", "message": message}
              for field, message in unknown_names(spec, settings.reward_modules)]
    if errors:
        raise InvalidInputError(f"{errors[0]['field']}: {errors[0]['message']}", code="UNKNOWN_NAME", details=errors)


def check_data(spec: RunSpec) -> None:
    """Read the spec's data files when this server can see all of them (the embedded case, or a data root
    mounted here too): a missing record field is a 422 naming `spec.task.path` (or `spec.eval.path`) now,
    not a run that fails on its hosts. A file the server cannot see may exist on the hosts, so it passes."""
    paths = [path for path in (spec.task.path, spec.eval.path if spec.eval else None) if path]
    if not paths or not all(os.path.isfile(path) for path in paths):
        return
    from locojax.spec import SpecError
    from locojax.tasks import load_task_data

    try:
        load_task_data(spec.task, spec.eval)
    except SpecError as exc:
        errors = [{"field": f"spec.{field}", "message": message} for field, message in exc.errors]
        raise InvalidInputError(f"{errors[0]['field']}: {errors[0]['message']}", code="INVALID_DATA",
                                details=errors) from None


def _by_idempotency_key(session: Session, key: str, owner_token_id: int | None) -> Run | None:
    """A key is looked up among the runs of the token that sent it only (keys are scoped per token)."""
    owner = Run.owner_token_id.is_(None) if owner_token_id is None else Run.owner_token_id == owner_token_id
    return session.scalar(select(Run).where(Run.idempotency_key == key, owner))


def create(session: Session, spec: RunSpec, settings: Settings, *, idempotency_key: str | None = None,
           created_by: str | None = None, owner_token_id: int | None) -> tuple[Run, bool]:
    """Store a new QUEUED run. Returns (run, created); created is False for an idempotent replay.
    `owner_token_id` has no default: every caller says who may cancel and resume the run (None: only
    admins), since a forgotten owner locks its submitter out of its own run."""
    digest = spec.digest()
    if idempotency_key is not None:
        existing = _by_idempotency_key(session, idempotency_key, owner_token_id)
        if existing is not None:
            return _replay(existing, digest), False
    check_paths(spec, settings)
    check_names(spec, settings)
    check_data(spec)
    decision_id = spec.placement.decision_id
    if decision_id is not None and session.get(PlacementDecision, decision_id) is None:
        raise InvalidInputError.for_field("spec.placement.decision_id", f"placement decision {decision_id} not found",
                                          code="DECISION_NOT_FOUND")
    run = Run(
        name=spec.name, spec=spec.model_dump(mode="json"), spec_digest=digest, status=S.QUEUED,
        mode=spec.placement.mode, hosts_needed=spec.placement.hosts, max_restarts=spec.max_restarts,
        restarts=0, attempt=0, cancel_requested=False, idempotency_key=idempotency_key,
        decision_id=decision_id, created_by=created_by, owner_token_id=owner_token_id, queued_since=utcnow(),
    )
    session.add(run)
    try:
        session.flush()
    except IntegrityError:
        # Two requests with one idempotency key raced; the other one's run stands.
        session.rollback()
        existing = _by_idempotency_key(session, idempotency_key, owner_token_id) if idempotency_key else None
        if existing is None:
            raise
        return _replay(existing, digest), False
    events.record(session, run.id, f"submitted by {created_by or 'unknown'}: {spec.placement.mode.upper()} on "
                                   f"{spec.placement.hosts} host(s), {spec.steps} steps")
    session.commit()
    return run, True


def _replay(run: Run, digest: str) -> Run:
    if run.spec_digest != digest:
        raise ConflictError("Idempotency-Key was already used with a different request body",
                            code="IDEMPOTENCY_KEY_REUSED", details={"run_id": run.id})
    return run


def get(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError(f"run {run_id} not found", code="RUN_NOT_FOUND")
    return run


def get_for_update(session: Session, run_id: int) -> Run:
    run = session.scalar(select(Run).where(Run.id == run_id).with_for_update())
    if run is None:
        raise NotFoundError(f"run {run_id} not found", code="RUN_NOT_FOUND")
    return run


# --- listing ----------------------------------------------------------------------------------------

def list_page(session: Session, *, limit: int, cursor: str | None = None, statuses: list[RunStatus] | None = None,
              name: str | None = None) -> tuple[list[Run], str | None]:
    """Newest first; keyset pagination on id, so pages stay stable while runs are being added."""
    query = select(Run)
    if statuses:
        query = query.where(Run.status.in_(statuses))
    if name:
        escaped = name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        query = query.where(Run.name.ilike(f"%{escaped}%", escape="\\"))
    return pagination.page(session, query, Run.id, limit=limit, cursor=cursor)


# --- user actions -----------------------------------------------------------------------------------

def cancel(session: Session, run_id: int, *, by: str | None = None) -> Run:
    """QUEUED runs end at once; started ones go CANCELLING and stop at the next step boundary."""
    run = get_for_update(session, run_id)
    status = RunStatus(run.status)
    if status is S.CANCELLING:
        return run  # already on its way; cancelling twice is not an error
    target = S.CANCELLED if status is S.QUEUED else S.CANCELLING
    reason = f"cancelled by {by}" if by else "cancelled"
    if status is S.QUEUED:
        reason += " before it started"
    transition(session, run, target, reason=reason)
    session.commit()
    return run


def resume(session: Session, run_id: int, *, by: str | None = None) -> Run:
    run = get_for_update(session, run_id)
    step = run.last_checkpoint_step
    origin = f"from the checkpoint at step {step}" if step is not None else "from the start (no checkpoint yet)"
    transition(session, run, S.QUEUED, reason=f"resumed {origin}" + (f" by {by}" if by else ""), reopen=True)
    session.commit()
    return run


def delete_run(session: Session, run_id: int) -> None:
    run = get_for_update(session, run_id)
    if RunStatus(run.status) not in TERMINAL_STATES:
        raise ConflictError(f"run {run_id} is {run.status.value}; only finished runs can be deleted",
                            code="RUN_NOT_TERMINAL", details={"run_id": run_id, "status": run.status.value})
    # Explicit deletes rather than trusting ON DELETE CASCADE: SQLite enforces it only with a pragma.
    for model in (StepMetric, StepMetricRollup, StepMetricSeries, RunEvent, RunHost):
        session.execute(delete(model).where(model.run_id == run_id))
    # Its observation stays (the calibration was fitted on it); only the link to the run goes.
    session.execute(update(CalibrationObservation).where(CalibrationObservation.run_id == run_id).values(run_id=None))
    session.execute(update(Host).where(Host.reserved_by_run_id == run_id).values(reserved_by_run_id=None))
    session.delete(run)
    session.commit()


# --- worker reports ---------------------------------------------------------------------------------

def report_transition(session: Session, run_id: int, to: RunStatus, *, reason: str | None,
                      expected: RunStatus | None, source: str) -> Run:
    run = get_for_update(session, run_id)
    if run.status == to:
        return run  # a retried report; already applied
    if expected is not None and run.status != expected:
        raise ConflictError(f"run {run_id} is {run.status.value}, not {expected.value}", code="RUN_STATE_CHANGED",
                            details={"run_id": run_id, "status": run.status.value, "expected": expected.value})
    transition(session, run, to, reason=reason, source=source)
    session.commit()
    return run


def report_checkpoint(session: Session, run_id: int, step: int, *, source: str) -> Run:
    run = get_for_update(session, run_id)
    if run.last_checkpoint_step is None or step > run.last_checkpoint_step:
        run.last_checkpoint_step = step
        run.updated_at = utcnow()
        events.record(session, run_id, f"checkpoint saved at step {step}", source=source)
    session.commit()
    return run


def list_host_processes(session: Session, run_id: int, attempt: int | None) -> list[RunHost]:
    run = get(session, run_id)
    query = select(RunHost).where(RunHost.run_id == run_id, RunHost.attempt == (run.attempt if attempt is None else attempt))
    return list(session.scalars(query.order_by(RunHost.process_index)))
