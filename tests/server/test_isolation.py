"""Isolation between runs, tenants and hosts (issue 17), on both backends: what one token holder may not
do to another's runs, what a worker token may not do outside its hosts and its run's current attempt,
and which directories a spec may not name. Scheduling that cannot be wedged: tests/server/test_scheduling.py."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from server.models import ApiToken, Host, HostProcessStatus, HostRole, Run, RunEvent, RunHost, RunStatus, utcnow
from server.services import scheduling
from server.services import tokens as token_service
from tests.server.helpers import assert_error, insert_run

S = RunStatus
SPEC = {"name": "mine", "steps": 3}


def _token(db, name: str, scopes: list[str], hosts: str | None = None) -> dict[str, str]:
    with db.write_session() as session:
        _, secret = token_service.create(session, name=name, scopes=scopes, hosts=hosts)
    return {"Authorization": f"Bearer {secret}"}


def _token_id(db, name: str) -> int:
    with db.read_session() as session:
        return session.scalar(select(ApiToken.id).where(ApiToken.name == name))


@pytest.fixture
def other_submitter(db) -> dict[str, str]:
    return _token(db, f"other-{os.urandom(3).hex()}", ["submit"])


def _place(db, run_id: int, host: str, *, attempt: int = 0, index: int = 0) -> None:
    with db.write_session() as session:
        session.add(RunHost(run_id=run_id, attempt=attempt, process_index=index, host_name=host, role=HostRole.CO,
                            status=HostProcessStatus.RUNNING))
        session.commit()


# --- ownership ----------------------------------------------------------------------------------------

def test_a_submitter_reads_every_run_but_acts_only_on_its_own(client, submitter, other_submitter, admin):
    mine = client.post("/api/v1/runs", json={"spec": SPEC}, headers=submitter).json()
    assert client.get(f"/api/v1/runs/{mine['id']}", headers=other_submitter).status_code == 200
    assert mine["id"] in [r["id"] for r in client.get("/api/v1/runs", headers=other_submitter).json()["data"]]
    for action in ("cancel", "resume"):
        error = assert_error(client.post(f"/api/v1/runs/{mine['id']}/{action}", headers=other_submitter), 403,
                             "RUN_NOT_OWNED")
        assert error["details"] == {"run_id": mine["id"], "action": action}
    assert client.post(f"/api/v1/runs/{mine['id']}/cancel", headers=submitter).json()["status"] == "CANCELLED"
    assert_error(client.delete(f"/api/v1/runs/{mine['id']}", headers=other_submitter), 403, "RUN_NOT_OWNED")
    assert_error(client.post(f"/api/v1/runs/{mine['id']}/resume", headers=other_submitter), 403, "RUN_NOT_OWNED")
    # An admin may act on any run.
    assert client.post(f"/api/v1/runs/{mine['id']}/resume", headers=admin).json()["status"] == "QUEUED"
    assert client.post(f"/api/v1/runs/{mine['id']}/cancel", headers=admin).json()["status"] == "CANCELLED"
    assert client.delete(f"/api/v1/runs/{mine['id']}", headers=admin).status_code == 204


def test_idempotency_keys_are_scoped_to_their_token(client, db, submitter, other_submitter):
    key = {"Idempotency-Key": "nightly-1"}
    first = client.post("/api/v1/runs", json={"spec": SPEC}, headers={**submitter, **key})
    theirs = client.post("/api/v1/runs", json={"spec": SPEC}, headers={**other_submitter, **key})
    assert (first.status_code, theirs.status_code) == (201, 201)
    assert theirs.json()["id"] != first.json()["id"]  # never the first token's run
    replay = client.post("/api/v1/runs", json={"spec": SPEC}, headers={**other_submitter, **key})
    assert (replay.status_code, replay.json()["id"]) == (200, theirs.json()["id"])
    changed = client.post("/api/v1/runs", json={"spec": {**SPEC, "steps": 4}}, headers={**other_submitter, **key})
    assert_error(changed, 409, "IDEMPOTENCY_KEY_REUSED")
    with db.read_session() as session:
        assert session.scalar(select(Run.owner_token_id).where(Run.id == first.json()["id"])) != \
            session.scalar(select(Run.owner_token_id).where(Run.id == theirs.json()["id"]))


# --- worker tokens are bound to hosts ---------------------------------------------------------------------

def test_worker_tokens_must_name_their_hosts(client, admin):
    for body, field in [({"name": "w", "scopes": ["worker"]}, "hosts"),
                        ({"name": "w", "scopes": ["worker"], "hosts": "*"}, "hosts"),
                        ({"name": "w", "scopes": ["worker"], "hosts": "a*b"}, "hosts"),
                        ({"name": "s", "scopes": ["submit"], "hosts": "tpu-1"}, "hosts")]:
        error = assert_error(client.post("/api/v1/tokens", json=body, headers=admin), 422)
        assert [item["field"] for item in error["details"]] == [field]
    made = client.post("/api/v1/tokens", json={"name": "w", "scopes": ["worker"], "hosts": "tpu-*"}, headers=admin)
    assert made.status_code == 201 and made.json()["hosts"] == "tpu-*"


def test_a_worker_token_registers_and_heartbeats_only_its_hosts(client, db, worker, submitter):
    exact = _token(db, "exact-worker", ["worker"], hosts="gpu-7")
    assert client.post("/api/v1/hosts", json={"name": "gpu-7"}, headers=exact).status_code == 200
    for name in ("gpu-70", "gpu-8", "h0"):  # an exact binding is not a prefix
        assert_error(client.post("/api/v1/hosts", json={"name": name}, headers=exact), 403, "HOST_NOT_BOUND")
    assert client.post("/api/v1/hosts", json={"name": "h-box"}, headers=worker).status_code == 200  # h* binds h-box
    assert_error(client.post("/api/v1/hosts/gpu-7/heartbeat", headers=worker), 403, "HOST_NOT_BOUND")
    assert_error(client.delete("/api/v1/hosts/gpu-7", headers=worker), 403, "HOST_NOT_BOUND")
    assert [h["name"] for h in client.get("/api/v1/hosts", headers=submitter).json()["data"]] == ["gpu-7", "h-box"]


def test_a_live_host_is_not_taken_over_by_another_worker_instance(client, db, worker, backend):
    first = {"name": "h-live", "info": {"instance": "a"}}
    assert client.post("/api/v1/hosts", json=first, headers=worker).status_code == 200
    assert client.post("/api/v1/hosts", json=first, headers=worker).status_code == 200  # the same worker again
    error = assert_error(client.post("/api/v1/hosts", json={"name": "h-live", "info": {"instance": "b"}},
                                     headers=worker), 409, "HOST_IN_USE")
    assert error["details"]["host"] == "h-live"
    with db.write_session() as session:  # the first worker went silent
        session.execute(update(Host).where(Host.name == "h-live").values(
            last_heartbeat=utcnow() - timedelta(seconds=backend.settings.host_stale_s + 1)))
        session.commit()
    taken = client.post("/api/v1/hosts", json={"name": "h-live", "info": {"instance": "b"}}, headers=worker)
    assert taken.status_code == 200 and _registered_instance(db, "h-live") == "b"


def _registered_instance(db, name: str) -> str | None:
    with db.read_session() as session:
        return (session.scalar(select(Host.info).where(Host.name == name)) or {}).get("instance")


def test_no_reader_learns_a_live_workers_instance_to_pose_as_it(client, db, worker, submitter, admin):
    """The takeover guard trusts the instance nonce: shown to readers, it let any holder of a token for
    the host (a fleet token, vm*) copy it and register as the live worker."""
    secret = "nonce-of-the-live-worker"
    registered = client.post("/api/v1/hosts", json={"name": "h-live", "info": {"instance": secret, "cores": [0]}},
                             headers=worker)
    assert registered.status_code == 200
    seen = [registered, client.get("/api/v1/hosts/h-live", headers=submitter),
            client.get("/api/v1/hosts", headers=admin), client.post("/api/v1/hosts/h-live/heartbeat", headers=worker),
            client.post("/api/v1/hosts/h-live/heartbeat", json={"info": {"load": 1}}, headers=worker)]
    for response in seen:
        assert response.status_code == 200 and secret not in response.text, response.request.url
    assert registered.json()["info"] == {"cores": [0]}  # the rest of the info is still shown
    assert _registered_instance(db, "h-live") == secret  # kept by the heartbeat that did not name it
    intruder = client.post("/api/v1/hosts", json={"name": "h-live", "info": {"instance": "a-guess"}}, headers=worker)
    assert_error(intruder, 409, "HOST_IN_USE")


def test_a_heartbeat_cannot_rename_the_live_worker(client, db, worker):
    """The other way round the guard: rename the live worker with a heartbeat, then register as the new name."""
    assert client.post("/api/v1/hosts", json={"name": "h-live", "info": {"instance": "real"}},
                       headers=worker).status_code == 200
    error = assert_error(client.post("/api/v1/hosts/h-live/heartbeat", json={"info": {"instance": "evil"}},
                                     headers=worker), 409, "HOST_IN_USE")
    assert error["details"] == {"host": "h-live", "field": "info.instance"}
    assert_error(client.post("/api/v1/hosts", json={"name": "h-live", "info": {"instance": "evil"}}, headers=worker),
                 409, "HOST_IN_USE")
    assert _registered_instance(db, "h-live") == "real"
    # The live worker's own heartbeats go on: naming its instance, or none.
    for body in ({"info": {"instance": "real", "load": 2}}, {"info": {"load": 3}}, None):
        assert client.post("/api/v1/hosts/h-live/heartbeat", json=body, headers=worker).status_code == 200
    assert _registered_instance(db, "h-live") == "real"


def test_a_forged_process_row_is_refused_and_the_scheduler_keeps_starting_runs(client, db, worker, backend):
    """The original wedge: a worker token created a run_hosts row for a QUEUED run, and every later tick
    failed on the unique constraint when the scheduler placed that run."""
    client.post("/api/v1/hosts", json={"name": "h0"}, headers=worker)
    run_id = insert_run(db, S.QUEUED)
    forged = {"host_name": "h0", "role": "co", "status": "EXITED", "attempt": 0}
    assert_error(client.put(f"/api/v1/runs/{run_id}/hosts/0", json=forged, headers=worker), 409, "PROCESS_NOT_PLACED")
    with db.write_session() as session:
        messages = scheduling.tick(session, backend.settings)
    assert [(m.run_id, m.host_name) for m in messages] == [(run_id, "h0")]
    # Placed now, but on h0: another bound token (h* does not cover gpu-1) cannot report for it, and
    # the h* token cannot name a host the process is not on.
    gpu = _token(db, "gpu-worker", ["worker"], hosts="gpu-1")
    report = {"host_name": "h0", "role": "co", "status": "RUNNING", "pid": 9, "attempt": 0}
    assert_error(client.put(f"/api/v1/runs/{run_id}/hosts/0", json=report, headers=gpu), 403, "HOST_NOT_BOUND")
    moved = {**report, "host_name": "h1"}
    assert_error(client.put(f"/api/v1/runs/{run_id}/hosts/0", json=moved, headers=worker), 403, "HOST_NOT_PLACED")
    assert client.put(f"/api/v1/runs/{run_id}/hosts/0", json=report, headers=worker).json()["pid"] == 9


def test_workers_report_metrics_and_events_only_for_their_hosts_processes(client, db, worker):
    run_id = insert_run(db, S.RUNNING, placed_on="x-other")  # process 0 runs on a host h* does not cover
    batch = {"rows": [{"step": 0, "values": {"loss": 1.0}}], "attempt": 0}
    assert_error(client.post(f"/api/v1/runs/{run_id}/metrics", json=batch, headers=worker), 403, "HOST_NOT_PLACED")
    events = {"events": [{"message": "hi", "seq": 1}], "attempt": 0}
    assert_error(client.post(f"/api/v1/runs/{run_id}/events", json=events, headers=worker), 403, "HOST_NOT_PLACED")
    checkpoint = {"step": 5, "attempt": 0}
    assert_error(client.post(f"/api/v1/runs/{run_id}/checkpoints", json=checkpoint, headers=worker), 403,
                 "HOST_NOT_PLACED")
    assert_error(client.post(f"/api/v1/runs/{run_id}/metrics", json={**batch, "host_name": "x-other"},
                             headers=worker), 403, "HOST_NOT_BOUND")


def test_only_the_process_that_writes_the_metrics_reports_them(client, db, worker, admin):
    """Process 0 writes metrics.jsonl (every host's rows and the aggregate) and its host relays it, and the
    run's checkpoints; another host of the run has none to relay, so its rows, for its own index, another's
    or the aggregate, and its checkpoint reports are refused."""
    run_id = insert_run(db, S.RUNNING)
    _place(db, run_id, "x-zero", index=0)  # a host the h* token is not bound to
    _place(db, run_id, "h-one", index=1)
    for host_name in ("h-one", None):
        for index in (1, 0, -1):
            batch = {"rows": [{"step": 0, "host": index, "values": {"loss": 6.0}}], "attempt": 0,
                     "host_name": host_name}
            error = assert_error(client.post(f"/api/v1/runs/{run_id}/metrics", json=batch, headers=worker), 403,
                                 "NOT_METRICS_PROCESS")
            assert error["details"]["process_index"] == 1 and error["details"]["host"] == "h-one"
    # Its events are its own to report.
    events = {"events": [{"message": "from process 1", "seq": 1}], "attempt": 0, "host_name": "h-one"}
    assert client.post(f"/api/v1/runs/{run_id}/events", json=events, headers=worker).json()["accepted"] == 1
    assert client.get(f"/api/v1/runs/{run_id}/metrics/keys", headers=admin).json()["keys"] == []
    # Process 0 also reports the run's checkpoints; a checkpoint from process 1 would be forged too.
    checkpoint = {"step": 5, "attempt": 0, "host_name": "h-one"}
    assert_error(client.post(f"/api/v1/runs/{run_id}/checkpoints", json=checkpoint, headers=worker), 403,
                 "NOT_METRICS_PROCESS")
    assert client.get(f"/api/v1/runs/{run_id}", headers=admin).json()["last_checkpoint_step"] is None
    zero = _token(db, "zero-worker", ["worker"], hosts="x-zero")
    batch = {"rows": [{"step": 0, "host": -1, "values": {"loss": 1.0}},
                      {"step": 0, "host": 1, "values": {"loss": 2.0}}], "attempt": 0}
    assert client.post(f"/api/v1/runs/{run_id}/metrics", json=batch, headers=zero).json()["values"] == 2
    checkpoint = {"step": 5, "attempt": 0, "host_name": "x-zero"}
    assert client.post(f"/api/v1/runs/{run_id}/checkpoints", json=checkpoint, headers=zero).json()[
        "last_checkpoint_step"] == 5


def test_the_server_names_each_events_source_and_time(client, db, worker, submitter):
    run_id = insert_run(db, S.RUNNING)
    _place(db, run_id, "h-a", index=0)
    _place(db, run_id, "h-b", index=1)
    for body in ({"events": [{"message": "x", "source": "scheduler"}], "attempt": 0},
                 {"events": [{"message": "x", "ts": "2001-01-01T00:00:00Z"}], "attempt": 0}):
        error = assert_error(client.post(f"/api/v1/runs/{run_id}/events", json=body, headers=worker), 422)
        assert error["details"][0]["field"].startswith("events.0.")
    before = utcnow()
    for host in ("h-b", "h-a"):
        body = {"events": [{"message": f"from {host}", "seq": 1}], "attempt": 0, "host_name": host}
        assert client.post(f"/api/v1/runs/{run_id}/events", json=body, headers=worker).json()["accepted"] == 1
    with db.read_session() as session:
        rows = list(session.scalars(select(RunEvent).where(RunEvent.run_id == run_id).order_by(RunEvent.id)))
    assert [(row.message, row.source) for row in rows] == [("from h-b", "host1"), ("from h-a", "host0")]
    assert all(row.ts >= before - timedelta(seconds=1) for row in rows)  # the server's clock, not the sender's


# --- attempts ---------------------------------------------------------------------------------------------

def test_reports_of_a_stale_attempt_or_a_finished_run_are_409(client, db, worker, admin):
    run_id = insert_run(db, S.RUNNING, attempt=2)
    _place(db, run_id, "h0", attempt=1)  # the killed attempt
    _place(db, run_id, "h1", attempt=2)  # the current one
    rows = [{"step": 3, "values": {"loss": 9.0}}]
    stale = [("metrics", {"rows": rows, "attempt": 1}), ("events", {"events": [{"message": "old"}], "attempt": 1}),
             ("checkpoints", {"step": 7, "attempt": 1})]
    for route, body in stale:
        error = assert_error(client.post(f"/api/v1/runs/{run_id}/{route}", json=body, headers=worker), 409,
                             "STALE_ATTEMPT")
        assert error["details"]["current_attempt"] == 2
    alive = {"host_name": "h0", "role": "co", "status": "RUNNING", "pid": 5, "attempt": 1}
    assert_error(client.put(f"/api/v1/runs/{run_id}/hosts/0", json=alive, headers=worker), 409, "STALE_ATTEMPT")
    # The old process ending is still recorded (the scheduler need not wait it out); the run does not follow.
    ended = {**alive, "status": "KILLED", "exit_code": -15}
    assert client.put(f"/api/v1/runs/{run_id}/hosts/0", json=ended, headers=worker).json()["status"] == "KILLED"
    assert client.get(f"/api/v1/runs/{run_id}", headers=admin).json()["status"] == "RUNNING"
    current = {"rows": rows, "attempt": 2}
    assert client.post(f"/api/v1/runs/{run_id}/metrics", json=current, headers=worker).status_code == 200
    assert client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": "FAILED"}, headers=admin).status_code == 200
    for route, body in [("metrics", current), ("events", {"events": [{"message": "late"}], "attempt": 2}),
                        ("checkpoints", {"step": 9, "attempt": 2})]:
        assert_error(client.post(f"/api/v1/runs/{run_id}/{route}", json=body, headers=worker), 409, "RUN_FINISHED")
    with db.read_session() as session:
        run = session.get(Run, run_id)
        assert run.last_checkpoint_step is None  # no stale or late checkpoint moved it


# --- run directories and data paths ---------------------------------------------------------------------

def test_specs_cannot_choose_run_directories_or_read_outside_the_roots(client, db, submitter, backend, tmp_path):
    settings = backend.settings
    data = settings.data_roots[0]
    outside = tmp_path / "secret.jsonl"
    outside.write_text('{"question": "q", "answer": "#### 1"}\n')
    link = data / f"link-{os.urandom(3).hex()}.jsonl"
    link.symlink_to(outside)
    try:
        cases = [
            ({"output_dir": str(settings.runs_root / "mine")}, "spec.output_dir"),  # inside runs_root: still refused
            ({"output_dir": str(settings.runs_root)}, "spec.output_dir"),
            ({"checkpoint": {"dir": str(settings.runs_root / "1-other" / "checkpoints")}}, "spec.checkpoint.dir"),
            ({"task": {"name": "gsm8k", "path": "gsm8k.jsonl"}}, "spec.task.path"),  # relative
            ({"task": {"name": "gsm8k", "path": str(link)}}, "spec.task.path"),  # a link out of the data root
            ({"model": {"checkpoint": "runs/1-sft/model"}}, "spec.model.checkpoint"),
        ]
        for changes, field in cases:
            error = assert_error(client.post("/api/v1/runs", json={"spec": {"name": "paths", **changes}},
                                             headers=submitter), 422, "PATH_NOT_ALLOWED")
            assert [item["field"] for item in error["details"]] == [field], changes
    finally:
        link.unlink()
    with db.read_session() as session:
        assert session.scalar(select(Run.id)) is None  # nothing stored
    run = client.post("/api/v1/runs", json={"spec": {"name": "placed"}}, headers=submitter).json()
    with db.read_session() as session:
        directory = scheduling.output_dir(session.get(Run, run["id"]), settings)
    assert directory == str(settings.runs_root / f"{run['id']}-placed") and os.path.isabs(directory)


def test_a_spec_reads_only_a_runs_exported_model_under_runs_root(client, db, submitter, backend):
    """The runs root is readable only for what it is there for: an SFT run's exported `model/`, which a GRPO
    spec starts from. Not another tenant's checkpoints, metrics or `.control/` (start specs, attempt secrets)."""
    settings = backend.settings
    other = settings.runs_root / f"3-other-{os.urandom(3).hex()}"
    for relative in ("model/config.json", "checkpoints/5/state", "metrics.jsonl", ".control/secret-attempt0-host0"):
        (other / relative).parent.mkdir(parents=True, exist_ok=True)
        (other / relative).write_text("x")
    (other / "model" / "peek").symlink_to(other / ".control")  # a link out of the export, into .control
    data_link = settings.data_roots[0] / f"runs-link-{os.urandom(3).hex()}"
    data_link.symlink_to(other / "checkpoints")  # a data-root link into a run's directory
    try:
        refused = [
            ({"model": {"checkpoint": str(other / "checkpoints" / "5")}}, "spec.model.checkpoint"),
            ({"model": {"checkpoint": str(other)}}, "spec.model.checkpoint"),
            ({"model": {"checkpoint": str(settings.runs_root)}}, "spec.model.checkpoint"),
            ({"task": {"name": "gsm8k", "path": str(other / "metrics.jsonl")}}, "spec.task.path"),
            ({"model": {"tokenizer": str(other / ".control" / "secret-attempt0-host0")}}, "spec.model.tokenizer"),
            ({"model": {"tokenizer": str(other / "model" / ".." / ".control")}}, "spec.model.tokenizer"),
            ({"model": {"tokenizer": str(other / "model" / "peek" / "secret-attempt0-host0")}}, "spec.model.tokenizer"),
            ({"model": {"checkpoint": str(data_link / "5")}}, "spec.model.checkpoint"),
        ]
        for changes, field in refused:
            error = assert_error(client.post("/api/v1/runs", json={"spec": {"name": "peek", **changes}},
                                             headers=submitter), 422, "PATH_NOT_ALLOWED")
            assert [item["field"] for item in error["details"]] == [field], changes
        with db.read_session() as session:
            assert session.scalar(select(Run.id)) is None
        for model in ({"checkpoint": str(other / "model")},
                      {"checkpoint": str(other / "model"), "tokenizer": str(other / "model" / "config.json")}):
            assert client.post("/api/v1/runs", json={"spec": {"name": "from-sft", "model": model}},
                               headers=submitter).status_code == 201, model
    finally:
        data_link.unlink()
