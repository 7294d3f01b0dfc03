"""The run state machine: every (from, to) pair, legal or not, and what a transition writes."""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy import func, select

from server.errors import ConflictError, IllegalTransitionError
from server.models import (
    AGGREGATE_HOST,
    TERMINAL_STATES,
    Host,
    HostRecordStatus,
    PlacementDecision,
    Run,
    RunEvent,
    RunStatus,
    StepMetric,
)
from server.services import runs as run_service
from server.services.runs import RESUMABLE, TRANSITIONS
from tests.server.helpers import insert_run

S = RunStatus

# The designed lifecycle (DESIGN.md section 7), written out here rather than read from the product's
# `TRANSITIONS`, so that a wrong edge in the product fails a test instead of moving the expectation
# with it. Rows: from; columns: to; "x" legal, "." illegal. Column order:
#              QUEUED STARTING RUNNING CANCELLING RECOVERING SUCCEEDED FAILED CANCELLED
EXPECTED_TABLE = """
QUEUED         .      x        .       .          .          .         x      x
STARTING       x      .        x       x          x          .         x      .
RUNNING        .      .        .       x          x          x         x      .
CANCELLING     .      .        .       .          .          x         x      x
RECOVERING     x      x        .       x          .          .         x      x
SUCCEEDED      .      .        .       .          .          .         .      .
FAILED         .      .        .       .          .          .         .      .
CANCELLED      .      .        .       .          .          .         .      .
"""
COLUMNS = (S.QUEUED, S.STARTING, S.RUNNING, S.CANCELLING, S.RECOVERING, S.SUCCEEDED, S.FAILED, S.CANCELLED)


def _expected_legal() -> set[tuple[RunStatus, RunStatus]]:
    legal = set()
    for line in EXPECTED_TABLE.strip().splitlines():
        name, *marks = line.split()
        assert len(marks) == len(COLUMNS), line
        legal |= {(S(name), target) for target, mark in zip(COLUMNS, marks) if mark == "x"}
    return legal


ALL_PAIRS = list(itertools.product(RunStatus, RunStatus))
EXPECTED_LEGAL = _expected_legal()
LEGAL = [pair for pair in ALL_PAIRS if pair in EXPECTED_LEGAL]
ILLEGAL = [pair for pair in ALL_PAIRS if pair not in EXPECTED_LEGAL]


def _event_count(session, run_id: int) -> int:
    return session.scalar(select(func.count()).select_from(RunEvent).where(RunEvent.run_id == run_id))


def test_the_table_is_the_designed_lifecycle():
    assert set(COLUMNS) == set(RunStatus)  # a new state must be added to the table above
    assert {(a, b) for a in RunStatus for b in TRANSITIONS[a]} == EXPECTED_LEGAL
    assert all(not TRANSITIONS[state] for state in TERMINAL_STATES)
    assert RESUMABLE == {S.FAILED, S.CANCELLED}
    # Every non-terminal state can still end: no run can get stuck without a way to FAILED.
    assert all(S.FAILED in TRANSITIONS[state] for state in RunStatus if state not in TERMINAL_STATES)


@pytest.mark.parametrize(("current", "target"), ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_illegal_transition_raises_and_writes_nothing(db, session, current, target):
    run_id = insert_run(db, current)
    run = session.get(Run, run_id)
    before_updated = run.updated_at
    with pytest.raises(IllegalTransitionError) as raised:
        run_service.transition(session, run, target, reason="test")
    assert raised.value.details["from"] == current.value and raised.value.details["to"] == target.value
    session.commit()  # even committing afterwards must persist nothing
    with db.read_session() as fresh:
        stored = fresh.get(Run, run_id)
        assert stored.status == current
        assert stored.updated_at == before_updated
        assert _event_count(fresh, run_id) == 0


@pytest.mark.parametrize(("current", "target"), LEGAL, ids=[f"{a.value}->{b.value}" for a, b in LEGAL])
def test_legal_transition_is_written_with_an_event(db, session, current, target):
    run_id = insert_run(db, current)
    run = session.get(Run, run_id)
    run_service.transition(session, run, target, reason="because")
    session.commit()
    with db.read_session() as fresh:
        stored = fresh.get(Run, run_id)
        assert stored.status == target
        assert stored.status_reason == "because"
        assert (stored.finished_at is not None) == (target in TERMINAL_STATES)
        messages = list(fresh.scalars(select(RunEvent.message).where(RunEvent.run_id == run_id)))
        assert messages == [f"{current.value} -> {target.value}: because"]


@pytest.mark.parametrize("current", list(RunStatus), ids=lambda s: s.value)
def test_reopen_only_from_failed_or_cancelled(db, session, current):
    run_id = insert_run(db, current, attempt=1, restarts=2, cancel_requested=True)
    run = session.get(Run, run_id)
    if current not in RESUMABLE:
        with pytest.raises(IllegalTransitionError):
            run_service.transition(session, run, S.QUEUED, reopen=True)
        session.rollback()
        assert session.get(Run, run_id).status == current
        return
    run_service.transition(session, run, S.QUEUED, reopen=True)
    session.commit()
    with db.read_session() as fresh:
        stored = fresh.get(Run, run_id)
        assert (stored.status, stored.attempt, stored.restarts, stored.cancel_requested) == (S.QUEUED, 2, 0, False)
        assert stored.finished_at is None


@pytest.mark.parametrize("target", [S.RUNNING, S.QUEUED, S.SUCCEEDED])
def test_reopen_goes_only_to_queued(db, session, target):
    run = session.get(Run, insert_run(db, S.FAILED))
    if target is S.QUEUED:
        run_service.transition(session, run, target, reopen=True)
        assert run.status == S.QUEUED
    else:
        with pytest.raises(IllegalTransitionError):
            run_service.transition(session, run, target, reopen=True)


def test_a_stale_writer_loses_and_writes_nothing(db):
    run_id = insert_run(db, S.RUNNING)
    with db.write_session() as first:
        stale = first.get(Run, run_id)  # read RUNNING ...
        first.commit()
        with db.write_session() as second:  # ... someone else finishes the run meanwhile
            run_service.transition(second, second.get(Run, run_id), S.SUCCEEDED)
            second.commit()
        with pytest.raises(ConflictError) as raised:  # RUNNING -> FAILED is legal, but the run moved on
            run_service.transition(first, stale, S.FAILED, reason="late")
        assert raised.value.code == "RUN_STATE_CHANGED"
        first.commit()
    with db.read_session() as fresh:
        assert fresh.get(Run, run_id).status == S.SUCCEEDED
        assert not any("late" in message for message in fresh.scalars(select(RunEvent.message)))


def test_side_effects_of_the_lifecycle(db, session):
    run = session.get(Run, insert_run(db, S.QUEUED))
    run_service.transition(session, run, S.STARTING)
    run_service.transition(session, run, S.RUNNING)
    started = run.started_at
    assert started is not None
    run_service.transition(session, run, S.RECOVERING, reason="host 1 lost")
    assert (run.restarts, run.attempt) == (1, 1)
    run_service.transition(session, run, S.STARTING)
    run_service.transition(session, run, S.RUNNING)
    assert run.started_at == started  # the first start is kept across recoveries
    run_service.transition(session, run, S.CANCELLING)
    assert run.cancel_requested
    run_service.transition(session, run, S.CANCELLED)
    session.commit()
    assert run.finished_at is not None


def test_finishing_releases_hosts_and_writes_measured_step_time_back(db, session):
    decision = PlacementDecision(request={}, options=[], choice={"mode": "co"}, reason="r", mode="co",
                                 predicted_step_s=1.5)
    session.add(decision)
    session.commit()
    run_id = insert_run(db, S.RUNNING, decision_id=decision.id)
    session.add(Host(name="h0", device_kind="cpu", device_count=1, status=HostRecordStatus.ONLINE,
                     reserved_by_run_id=run_id))
    for step, seconds in enumerate([9.0, 1.0, 2.0, 3.0]):  # a slow first (compile) step
        session.add(StepMetric(run_id=run_id, key="time/step", host=AGGREGATE_HOST, step=step, value=seconds))
        session.add(StepMetric(run_id=run_id, key="time/step", host=0, step=step, value=100.0))  # per-host: ignored
    session.commit()
    run_service.transition(session, session.get(Run, run_id), S.SUCCEEDED)
    session.commit()
    with db.read_session() as fresh:
        assert fresh.get(Run, run_id).measured_step_s == pytest.approx(2.5)
        stored = fresh.get(PlacementDecision, decision.id)
        assert stored.measured_step_s == pytest.approx(2.5) and stored.measured_run_id == run_id
        assert fresh.scalar(select(Host.reserved_by_run_id).where(Host.name == "h0")) is None


def test_recovery_stops_at_max_restarts(db, session):
    run = session.get(Run, insert_run(db, S.RUNNING, max_restarts=1))
    run_service.transition(session, run, S.RECOVERING, reason="host 0 lost")
    run_service.transition(session, run, S.STARTING)
    run_service.transition(session, run, S.RUNNING)
    session.commit()
    with pytest.raises(ConflictError) as raised:
        run_service.transition(session, run, S.RECOVERING, reason="host 1 lost")
    assert raised.value.code == "RESTARTS_EXHAUSTED"
    session.rollback()
    run_service.transition(session, session.get(Run, run.id), S.FAILED, reason="host 1 lost; restarts exhausted")
    session.commit()
    with db.read_session() as fresh:
        assert (fresh.get(Run, run.id).status, fresh.get(Run, run.id).restarts) == (S.FAILED, 1)
