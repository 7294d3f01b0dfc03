"""The gang scheduler, the reconciler and the run lifecycle, on both backends, without workers: each tick
is called with an explicit clock, so timeouts are tested without waiting for them."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import select

from server.models import Host, HostProcessStatus, HostRecordStatus, Run, RunHost, RunStatus, utcnow
from server.schemas import RunHostUpsert
from server.services import host_reports, lifecycle, scheduling
from server.services import runs as run_service
from tests.server.helpers import insert_run

S = RunStatus
P = HostProcessStatus


def add_hosts(db, *names: str, age_s: float = 0.0) -> None:
    with db.write_session() as session:
        for name in names:
            session.add(Host(name=name, device_kind="cpu", device_count=1, status=HostRecordStatus.ONLINE,
                             last_heartbeat=utcnow() - timedelta(seconds=age_s), info={}))
        session.commit()


def tick(backend, now=None, **settings):
    with backend.db.write_session() as session:
        return scheduling.tick(session, backend.settings.model_copy(update=settings), now)


def reserved(db) -> dict[str, int | None]:
    with db.read_session() as session:
        return {h.name: h.reserved_by_run_id for h in session.scalars(select(Host).order_by(Host.name))}


def run_row(db, run_id: int) -> Run:
    with db.read_session() as session:
        return session.get(Run, run_id)


def report(db, run_id: int, index: int, status: P, **fields) -> None:
    with db.write_session() as session:
        attempt = fields.pop("attempt", None)
        attempt = session.get(Run, run_id).attempt if attempt is None else attempt
        body = RunHostUpsert(host_name=fields.pop("host_name", f"h{index}"), role="co", status=status,
                             attempt=attempt, **fields)
        host_reports.upsert_host_process(session, run_id, index, body)


def test_a_run_gets_all_its_hosts_or_none(backend):
    add_hosts(backend.db, "h0", "h1", "h2")
    first = insert_run(backend.db, hosts_needed=2, name="first")
    second = insert_run(backend.db, hosts_needed=2, name="second")
    messages = tick(backend)
    assert [(m.run_id, m.process_index, m.num_processes) for m in messages] == [(first, 0, 2), (first, 1, 2)]
    assert reserved(backend.db) == {"h0": first, "h1": first, "h2": None}  # h2 stays free: never half of `second`
    assert run_row(backend.db, first).status is S.STARTING and run_row(backend.db, second).status is S.QUEUED
    assert tick(backend) == []

    with backend.db.write_session() as session:
        run_service.transition(session, session.get(Run, first), S.FAILED, reason="test")
        session.commit()
    messages = tick(backend)
    assert {m.host_name for m in messages} == {"h0", "h1"} and {m.run_id for m in messages} == {second}


def test_a_run_needing_more_hosts_than_exist_waits_with_a_reason_and_blocks_nobody(backend):
    add_hosts(backend.db, "h0", "h1")
    big = insert_run(backend.db, hosts_needed=512)
    small = insert_run(backend.db, hosts_needed=1)
    messages = tick(backend)
    assert [m.run_id for m in messages] == [small]
    assert run_row(backend.db, small).status is S.STARTING
    waiting = run_row(backend.db, big)
    assert waiting.status is S.QUEUED and "placement.hosts is 512" in waiting.status_reason
    assert "2 usable" in waiting.status_reason
    assert reserved(backend.db) == {"h0": small, "h1": None}  # the unsatisfiable run holds nothing


def _finish(db, run_id: int) -> None:
    with db.write_session() as session:
        run_service.transition(session, session.get(Run, run_id), S.FAILED, reason="test")
        session.commit()


def test_younger_runs_backfill_until_the_oldest_has_waited_then_it_holds_hosts_as_they_free(backend):
    add_hosts(backend.db, "h0", "h1")
    wait = {"backfill_wait_s": 5.0}
    busy = insert_run(backend.db, hosts_needed=1, name="busy")
    assert [m.run_id for m in tick(backend, **wait)] == [busy]  # on h0
    now = utcnow()
    oldest = insert_run(backend.db, hosts_needed=2, name="oldest", queued_since=now)
    young = insert_run(backend.db, hosts_needed=1, name="young", queued_since=now)
    # The oldest fits the cluster but not its free hosts: a younger run that fits starts meanwhile.
    assert [m.run_id for m in tick(backend, now, **wait)] == [young]
    assert "younger runs that fit may start" in run_row(backend.db, oldest).status_reason
    _finish(backend.db, young)  # h1 frees
    later = now + timedelta(seconds=6)
    younger = insert_run(backend.db, hosts_needed=1, name="younger", queued_since=later)
    # Past its wait the oldest holds every host that frees, so younger runs no longer overtake it.
    assert tick(backend, later, **wait) == []
    assert reserved(backend.db) == {"h0": busy, "h1": oldest}
    assert run_row(backend.db, younger).status is S.QUEUED
    assert "holding 1 of 2" in run_row(backend.db, oldest).status_reason
    _finish(backend.db, busy)
    assert {(m.run_id, m.host_name) for m in tick(backend, later, **wait)} == {(oldest, "h0"), (oldest, "h1")}
    assert run_row(backend.db, oldest).status is S.STARTING and run_row(backend.db, younger).status is S.QUEUED


def test_a_failure_starting_one_run_does_not_stop_the_others_in_the_same_tick(backend):
    add_hosts(backend.db, "h0", "h1")
    broken = insert_run(backend.db, hosts_needed=1, name="broken")
    healthy = insert_run(backend.db, hosts_needed=1, name="healthy")
    # A row of attempt 0 that the scheduler did not place (what a forged report used to create): the
    # start of `broken` hits the unique constraint of run_hosts.
    with backend.db.write_session() as session:
        session.add(RunHost(run_id=broken, attempt=0, process_index=0, host_name="elsewhere", role="co",
                            status=P.EXITED))
        session.commit()
    messages = tick(backend)
    assert [m.run_id for m in messages] == [healthy]
    failed = run_row(backend.db, broken)
    assert failed.status is S.QUEUED and failed.dispatch_failures == 1 and failed.not_before is not None
    assert "start failed" in failed.status_reason
    assert set(reserved(backend.db).values()) == {healthy, None}  # nothing left reserved for `broken`


def test_hosts_with_stale_heartbeats_are_not_reserved(backend):
    add_hosts(backend.db, "fresh")
    add_hosts(backend.db, "stale", age_s=backend.settings.host_stale_s + 1)
    run_id = insert_run(backend.db, hosts_needed=2)
    assert tick(backend) == []
    single = insert_run(backend.db, hosts_needed=1)
    with backend.db.write_session() as session:
        run_service.transition(session, session.get(Run, run_id), S.CANCELLED, reason="test")
        session.commit()
    assert [m.host_name for m in tick(backend)] == ["fresh"]
    assert run_row(backend.db, single).status is S.STARTING


def test_sc_starts_a_controller_and_a_worker_on_every_reserved_host(backend):
    add_hosts(backend.db, "h0", "h1", "h2")
    run_id = insert_run(backend.db, hosts_needed=3, mode="sc", spec={"name": "sc-run"})
    messages = tick(backend)
    assert [(m.host_name, m.process_index, m.num_processes, m.role) for m in messages] == [
        ("h0", 0, 3, "controller"), ("h1", 1, 3, "worker"), ("h2", 2, 3, "worker")]
    assert reserved(backend.db) == {"h0": run_id, "h1": run_id, "h2": run_id}
    # One secret per attempt, the same in every message of it, and never the empty one.
    assert len({m.secret for m in messages}) == 1 and len(messages[0].secret) >= 32


def test_a_da_run_starts_its_driver_and_a_ray_node_on_every_other_reserved_host(backend):
    add_hosts(backend.db, "h0", "h1", "h2")
    placement = {"mode": "da", "hosts": 3, "rollout_fraction": 0.34}  # 1 rollout host, 2 train hosts
    run_id = insert_run(backend.db, hosts_needed=3, mode="da", spec={"name": "da-run", "placement": placement})
    messages = tick(backend)
    assert [(m.host_name, m.process_index, m.num_processes, m.role) for m in messages] == [
        ("h0", 0, 3, "controller"), ("h1", 1, 3, "train"), ("h2", 2, 3, "rollout")]
    assert reserved(backend.db) == {"h0": run_id, "h1": run_id, "h2": run_id}


def test_an_attempt_that_does_not_start_in_time_is_requeued_with_backoff(backend):
    settings = backend.settings
    add_hosts(backend.db, "h0", "h1", "h2")
    run_id = insert_run(backend.db, hosts_needed=2)
    tick(backend)
    report(backend.db, run_id, 0, P.RUNNING, pid=10)  # host 1 never answers (a fake or broken worker)

    later = utcnow() + timedelta(seconds=settings.dispatch_resend_s + 0.5)
    resent = tick(backend, later)
    assert [(m.host_name, m.process_index) for m in resent] == [("h1", 1)]  # only the unclaimed one

    later = utcnow() + timedelta(seconds=settings.start_timeout_s + 1)
    with backend.db.write_session() as session:  # heartbeats keep coming meanwhile
        for host in session.scalars(select(Host)):
            host.last_heartbeat = later
        session.commit()
    assert tick(backend, later) == []  # backoff: not retried at once
    run = run_row(backend.db, run_id)
    assert (run.status, run.attempt, run.dispatch_failures) == (S.QUEUED, 1, 1)
    assert run.not_before == later + timedelta(seconds=settings.requeue_backoff_s)
    assert set(reserved(backend.db).values()) == {None}
    retry = tick(backend, run.not_before + timedelta(seconds=0.1))
    assert {(m.attempt, m.resume) for m in retry} == {(1, True)}
    # h1 took up nothing: it is benched (doubling per failure) rather than attracting the retry again.
    assert {m.host_name for m in retry} == {"h0", "h2"}
    with backend.db.read_session() as session:
        benched = session.scalar(select(Host).where(Host.name == "h1"))
        assert benched.start_failures == 1 and benched.not_before == later + timedelta(seconds=settings.start_timeout_s)
        assert session.scalar(select(Host).where(Host.name == "h0")).start_failures == 0


def test_a_lost_host_sends_its_run_to_recovery_and_the_group_restarts(backend):
    settings = backend.settings
    add_hosts(backend.db, "h0", "h1", "spare")
    run_id = insert_run(backend.db, hosts_needed=2, max_restarts=1)
    tick(backend)
    report(backend.db, run_id, 0, P.RUNNING, pid=10)
    report(backend.db, run_id, 1, P.RUNNING, pid=11)
    assert run_row(backend.db, run_id).status is S.RUNNING

    with backend.db.write_session() as session:  # h1 went silent host_lost_s ago
        session.scalar(select(Host).where(Host.name == "h1")).last_heartbeat = \
            utcnow() - timedelta(seconds=settings.host_lost_s + 1)
        session.commit()
    tick(backend)
    run = run_row(backend.db, run_id)
    assert (run.status, run.restarts, run.attempt) == (S.RECOVERING, 1, 1)
    assert "h1" in run.status_reason

    assert tick(backend) == []  # the old process on h0 is still alive
    report(backend.db, run_id, 0, P.KILLED, attempt=0, exit_code=-15)  # h0's worker stops the old process
    messages = tick(backend)
    assert sorted(m.host_name for m in messages) == ["h0", "spare"]
    assert {(m.attempt, m.resume) for m in messages} == {(1, True)}
    assert reserved(backend.db) == {"h0": run_id, "h1": None, "spare": run_id}
    assert run_row(backend.db, run_id).status is S.STARTING

    report(backend.db, run_id, 0, P.FAILED, host_name="h0", exit_code=1)  # out of restarts now
    run = run_row(backend.db, run_id)
    assert run.status is S.FAILED and "exit code 1" in run.status_reason and "after 1 restart" in run.status_reason


def test_no_host_is_lost_until_the_reconciler_has_watched_for_host_lost_s(backend):
    """After the database (or the API) was down, every heartbeat is old: that is the outage, not the hosts."""
    settings = backend.settings
    add_hosts(backend.db, "h0")
    run_id = insert_run(backend.db, hosts_needed=1)
    tick(backend)
    report(backend.db, run_id, 0, P.RUNNING, pid=10)
    now = utcnow()
    with backend.db.write_session() as session:  # silent all through an outage
        session.scalar(select(Host).where(Host.name == "h0")).last_heartbeat = \
            now - timedelta(seconds=settings.host_lost_s + 5)
        session.commit()
    with backend.db.write_session() as session:  # watching again for less than host_lost_s: no verdict yet
        scheduling.tick(session, settings, now, watching_since=now - timedelta(seconds=settings.host_lost_s - 1))
    assert run_row(backend.db, run_id).status is S.RUNNING
    with backend.db.write_session() as session:  # watched long enough, still silent: lost
        scheduling.tick(session, settings, now, watching_since=now - timedelta(seconds=settings.host_lost_s))
    assert run_row(backend.db, run_id).status is S.RECOVERING


def test_a_worker_restarted_under_its_name_loses_what_its_predecessor_ran(backend):
    """The engine processes die with their worker; a prompt restart must not leave their rows RUNNING."""
    from server.schemas import HostRegister
    from server.services import hosts as host_service

    def register(name: str, instance: str) -> None:
        with backend.db.write_session() as session:
            host_service.register(session, HostRegister(name=name, info={"instance": instance}))

    register("h0", "first")
    register("h1", "first")
    run_id = insert_run(backend.db, hosts_needed=2)
    tick(backend)
    report(backend.db, run_id, 0, P.RUNNING, pid=10, host_name="h0")
    register("h0", "first")  # the same worker registering again (e.g. after a 404) changes nothing
    assert run_row(backend.db, run_id).status is S.STARTING
    register("h1", "second")  # h1 never reported a pid: its start message is resent, not given up
    assert run_row(backend.db, run_id).status is S.STARTING
    register("h0", "second")
    run = run_row(backend.db, run_id)
    assert (run.status, run.attempt) == (S.RECOVERING, 1)
    assert "h0" in run.status_reason and "lost" in run.status_reason
    with backend.db.read_session() as session:
        rows = {row.process_index: row.status for row in session.scalars(select(RunHost).where(RunHost.attempt == 0))}
    assert rows == {0: P.LOST, 1: P.STARTING}


def test_recovery_waits_for_the_old_processes(backend):
    add_hosts(backend.db, "h0", "h1")
    run_id = insert_run(backend.db, hosts_needed=2)
    tick(backend)
    report(backend.db, run_id, 0, P.RUNNING, pid=10)
    report(backend.db, run_id, 1, P.FAILED, exit_code=-9)
    assert run_row(backend.db, run_id).status is S.RECOVERING
    assert tick(backend) == []  # process 0 of attempt 0 is still alive
    report(backend.db, run_id, 0, P.KILLED, attempt=0, exit_code=-15)
    assert len(tick(backend)) == 2


def test_lifecycle_from_process_reports(backend):
    add_hosts(backend.db, "h0", "h1")
    run_id = insert_run(backend.db, hosts_needed=2)
    tick(backend)
    report(backend.db, run_id, 0, P.RUNNING, pid=10)
    assert run_row(backend.db, run_id).status is S.STARTING  # not until every process started
    report(backend.db, run_id, 1, P.RUNNING, pid=11)
    assert run_row(backend.db, run_id).status is S.RUNNING
    report(backend.db, run_id, 1, P.EXITED, exit_code=0)
    assert run_row(backend.db, run_id).status is S.RUNNING
    report(backend.db, run_id, 0, P.EXITED, exit_code=0)
    assert run_row(backend.db, run_id).status is S.SUCCEEDED
    assert set(reserved(backend.db).values()) == {None}


@pytest.mark.parametrize("path", ["cancel_then_exit", "engine_cancelled_first"])
def test_cancel_ends_cancelled_once_no_process_is_alive(backend, path):
    add_hosts(backend.db, "h0")
    run_id = insert_run(backend.db, hosts_needed=1)
    tick(backend)
    report(backend.db, run_id, 0, P.RUNNING, pid=10)
    if path == "cancel_then_exit":
        with backend.db.write_session() as session:
            run_service.cancel(session, run_id, by="test")
        assert run_row(backend.db, run_id).status is S.CANCELLING
        tick(backend)
        assert run_row(backend.db, run_id).status is S.CANCELLING  # its process still runs
    report(backend.db, run_id, 0, P.EXITED, exit_code=lifecycle.EXIT_CANCELLED)
    assert run_row(backend.db, run_id).status is S.CANCELLED


def test_cancelling_a_run_whose_processes_never_started(backend):
    add_hosts(backend.db, "h0")
    run_id = insert_run(backend.db, hosts_needed=1)
    tick(backend)
    with backend.db.write_session() as session:
        run_service.cancel(session, run_id, by="test")
    tick(backend)
    assert run_row(backend.db, run_id).status is S.CANCELLED


@pytest.mark.postgres
def test_concurrent_schedulers_never_share_or_split_hosts(backend_factory):
    backend = backend_factory("postgres")
    from tests.server.conftest import _empty_tables

    _empty_tables(backend.db)
    add_hosts(backend.db, *(f"h{i}" for i in range(5)))
    runs = [insert_run(backend.db, hosts_needed=2, name=f"r{i}") for i in range(4)]
    results: list[list] = []
    barrier = threading.Barrier(4)

    def scheduler() -> None:
        barrier.wait()
        results.append(tick(backend))

    threads = [threading.Thread(target=scheduler) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    messages = [m for batch in results for m in batch]
    holders = reserved(backend.db)
    started = {m.run_id for m in messages}
    assert len(started) == 2  # 5 hosts hold two runs of 2
    for run_id in runs:
        held = sum(1 for holder in holders.values() if holder == run_id)
        assert held == (2 if run_id in started else 0)
    assert len({(m.run_id, m.process_index) for m in messages}) == len(messages) == 4
    with backend.db.read_session() as session:
        rows = session.scalars(select(RunHost)).all()
        assert len(rows) == 4
