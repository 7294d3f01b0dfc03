"""Run events: append (idempotent by seq), list after a cursor, follow over SSE."""

from __future__ import annotations

import json
import threading
import time

from server.models import RunStatus
from tests.server.helpers import assert_error, insert_run


def _sse(text: str) -> list[tuple[str, dict, str | None]]:
    """(event, data, id) triples of an event-stream body; keep-alive comments are skipped."""
    events = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith(":") or ":" not in line:
                continue
            name, _, value = line.partition(":")
            fields[name] = value.lstrip()
        if "data" in fields:
            events.append((fields.get("event", "message"), json.loads(fields["data"]), fields.get("id")))
    return events


def test_append_and_list_after_a_cursor(client, db, worker, submitter):
    run_id = insert_run(db, RunStatus.RUNNING, placed_on="h0")
    batch = [{"message": f"step {i}", "seq": i} for i in range(5)]
    posted = client.post(f"/api/v1/runs/{run_id}/events", json={"events": batch, "attempt": 0}, headers=worker)
    assert posted.json()["accepted"] == 5
    # a retry of the same batch (plus one new line) stores only the new line
    retry = batch + [{"message": "step 5", "seq": 5}, {"message": "warn", "level": "warning"}]
    posted = client.post(f"/api/v1/runs/{run_id}/events", json={"events": retry, "attempt": 0}, headers=worker)
    assert posted.json()["accepted"] == 2
    first = client.get(f"/api/v1/runs/{run_id}/events", params={"limit": 4}, headers=submitter).json()
    assert [e["message"] for e in first["data"]] == ["step 0", "step 1", "step 2", "step 3"]
    rest = client.get(f"/api/v1/runs/{run_id}/events", params={"after": first["next_after"]}, headers=submitter).json()
    assert [e["message"] for e in rest["data"]] == ["step 4", "step 5", "warn"]
    done = client.get(f"/api/v1/runs/{run_id}/events", params={"after": rest["next_after"]}, headers=submitter).json()
    assert done == {"data": [], "next_after": rest["next_after"]}
    warnings = client.get(f"/api/v1/runs/{run_id}/events", params={"level": "warning"}, headers=submitter).json()["data"]
    assert [(e["message"], e["source"]) for e in warnings] == [("warn", "host0")]  # named by the server


def test_bad_event_batches_write_nothing(client, db, worker, submitter):
    run_id = insert_run(db, placed_on="h0")
    for body in ({"events": [], "attempt": 0}, {"events": [{"message": "ok"}, {"message": "x", "level": "loud"}],
                                                "attempt": 0},
                 {"events": [{"message": "ok"}, {"msg": "typo"}], "attempt": 0},
                 {"events": [{"message": "x" * 70000}], "attempt": 0},
                 {"events": [{"message": "ok"}]},  # no attempt
                 {"events": [{"message": "ok", "source": "scheduler"}], "attempt": 0}):  # the server names sources
        assert_error(client.post(f"/api/v1/runs/{run_id}/events", json=body, headers=worker), 422)
    assert client.get(f"/api/v1/runs/{run_id}/events", headers=submitter).json()["data"] == []
    assert_error(client.post("/api/v1/runs/777/events", json={"events": [{"message": "x"}], "attempt": 0},
                             headers=worker), 404)
    assert_error(client.get("/api/v1/runs/777/events", headers=worker), 404, "RUN_NOT_FOUND")


def test_sse_replays_a_finished_run_then_ends(client, submitter, worker):
    run_id = client.post("/api/v1/runs", json={"spec": {"name": "sse"}}, headers=submitter).json()["id"]
    client.post(f"/api/v1/runs/{run_id}/cancel", headers=submitter)
    with client.stream("GET", f"/api/v1/runs/{run_id}/events/stream", headers=submitter) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse(response.read().decode())
    kinds = [kind for kind, _, _ in events]
    assert kinds == ["status", "log", "log", "end"]
    assert events[0][1]["status"] == "CANCELLED" and events[-1][1]["status"] == "CANCELLED"
    assert events[2][1]["message"].startswith("QUEUED -> CANCELLED")
    assert events[1][2] == str(events[1][1]["id"])  # the SSE id is the event id (for Last-Event-ID)


def test_sse_follows_a_live_run_until_it_finishes(client, db, submitter, worker, admin):
    run_id = insert_run(db, RunStatus.RUNNING, placed_on="h0")

    def produce() -> None:
        for i in range(3):
            time.sleep(0.1)
            client.post(f"/api/v1/runs/{run_id}/events", json={"events": [{"message": f"live {i}"}], "attempt": 0},
                        headers=worker)
        client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": "SUCCEEDED"}, headers=admin)

    producer = threading.Thread(target=produce)
    with client.stream("GET", f"/api/v1/runs/{run_id}/events/stream", headers=submitter) as response:
        producer.start()
        body = response.read().decode()
    producer.join()
    events = _sse(body)
    logs = [data["message"] for kind, data, _ in events if kind == "log"]
    assert logs == ["live 0", "live 1", "live 2", "RUNNING -> SUCCEEDED"]
    statuses = [data["status"] for kind, data, _ in events if kind == "status"]
    # Ended by the terminal state: only that path sends `end` (a stream closed by sse_max_s does not,
    # see test_sse_closes_after_its_maximum_duration), so no wall-clock bound is needed here.
    assert statuses == ["RUNNING", "SUCCEEDED"] and events[-1][0] == "end"


def test_sse_resumes_after_last_event_id(client, db, submitter, worker, admin):
    run_id = insert_run(db, RunStatus.RUNNING, placed_on="h0")
    client.post(f"/api/v1/runs/{run_id}/events", json={"events": [{"message": f"m{i}"} for i in range(4)],
                                                       "attempt": 0}, headers=worker)
    client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": "FAILED"}, headers=admin)
    ids = [e["id"] for e in client.get(f"/api/v1/runs/{run_id}/events", headers=submitter).json()["data"]]
    with client.stream("GET", f"/api/v1/runs/{run_id}/events/stream",
                       headers={**submitter, "Last-Event-ID": str(ids[1])}) as response:
        events = _sse(response.read().decode())
    assert [data["message"] for kind, data, _ in events if kind == "log"] == ["m2", "m3", "RUNNING -> FAILED"]


def test_sse_closes_after_its_maximum_duration(client, db, submitter):
    run_id = insert_run(db, RunStatus.RUNNING)
    started = time.monotonic()
    with client.stream("GET", f"/api/v1/runs/{run_id}/events/stream", headers=submitter) as response:
        events = _sse(response.read().decode())
    # sse_max_s = 1.5 in the test settings: not closed before it; the upper bound only catches a
    # stream that ignores it, so it is wide enough for a loaded machine.
    assert 1.4 < time.monotonic() - started < 30
    assert [kind for kind, _, _ in events] == ["status"]  # no `end`: the run did not finish


def test_sse_of_unknown_run_is_404(client, submitter):
    assert_error(client.get("/api/v1/runs/4242/events/stream", headers=submitter), 404, "RUN_NOT_FOUND")



def test_event_streams_per_token_are_capped_and_slots_come_back(tmp_path):
    # A real server: the TestClient buffers whole responses, so two streams are never open at once there.
    import socket

    import httpx
    import uvicorn

    from server.app import create_app
    from server.db import upgrade_to_head
    from server.services import tokens as token_service
    from tests.server.conftest import make_settings

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade_to_head(url)
    app = create_app(make_settings(tmp_path, url, sse_streams_per_token=2, sse_max_s=60.0), plugins=False)
    with app.state.db.write_session() as session:
        secrets = {scope: token_service.create(session, name=scope, scopes=[scope],
                                               hosts="h*" if scope == "worker" else None)[1]
                   for scope in ("submit", "worker")}
    run_id = insert_run(app.state.db, RunStatus.RUNNING)  # never ends: streams stay open
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stream_url = f"http://127.0.0.1:{port}/api/v1/runs/{run_id}/events/stream"
    submitter = {"Authorization": f"Bearer {secrets['submit']}"}
    try:
        with httpx.Client(timeout=10) as client:
            with client.stream("GET", stream_url, headers=submitter) as one, \
                    client.stream("GET", stream_url, headers=submitter) as two:
                assert (one.status_code, two.status_code) == (200, 200)
                refused = client.get(stream_url, headers=submitter)
                assert refused.status_code == 429 and refused.json()["error"]["code"] == "TOO_MANY_STREAMS"
                assert refused.headers["retry-after"]
                other = {"Authorization": f"Bearer {secrets['worker']}"}
                with client.stream("GET", stream_url, headers=other) as third:
                    assert third.status_code == 200  # the cap is per token
            # Closed streams give their slots back.
            deadline = time.monotonic() + 10
            while app.state.stream_slots._open:
                assert time.monotonic() < deadline, app.state.stream_slots._open
                time.sleep(0.1)
            with client.stream("GET", stream_url, headers=submitter) as again:
                assert again.status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        app.state.db.dispose()
