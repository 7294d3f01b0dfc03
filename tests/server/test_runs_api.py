"""/api/v1/runs: submission, idempotency, listing, and the user and worker actions on each state."""

from __future__ import annotations

import json
import concurrent.futures
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from server.models import TERMINAL_STATES, HostProcessStatus, HostRole, Run, RunHost, RunStatus, StepMetric
from tests.server.helpers import assert_error, insert_run

S = RunStatus
SPEC = {"name": "arith-demo", "steps": 10, "placement": {"mode": "co", "hosts": 2}}


def _run_count(db) -> int:
    with db.read_session() as session:
        return session.scalar(select(func.count()).select_from(Run))


def test_create_returns_201_with_location_and_the_normalised_spec(client, submitter):
    response = client.post("/api/v1/runs", json={"spec": SPEC}, headers=submitter)
    assert response.status_code == 201, response.text
    run = response.json()
    assert response.headers["location"] == f"/api/v1/runs/{run['id']}"
    assert (run["status"], run["mode"], run["hosts_needed"], run["attempt"]) == ("QUEUED", "co", 2, 0)
    assert run["created_by"] == "test-submit"
    assert run["spec"]["rollout"]["group_size"] == 8  # defaults filled in
    assert client.get(f"/api/v1/runs/{run['id']}", headers=submitter).json() == run


@pytest.mark.parametrize(("spec", "field"), [
    ({"rollout": {"group_size": 0}}, "spec.rollout.group_size"),
    ({"rollout": {"group_sise": 4}}, "spec.rollout.group_sise"),
    ({"model": {"preset": "gpt-17"}}, "spec.model.preset"),
    ({"steps": "many"}, "spec.steps"),
    ({"placement": {"mode": "xx"}}, "spec.placement.mode"),
    ({"name": "has space"}, "spec.name"),
    ({"task": {"name": "gsm8k"}}, "spec.task"),
    ({"placement": {"mode": "da", "hosts": 1}}, "spec.placement"),
    ({"optim": {"lr": -1}}, "spec.optim.lr"),
])
def test_spec_errors_are_422_naming_the_field_and_write_nothing(client, db, submitter, spec, field):
    error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422, "VALIDATION_ERROR")
    assert field in [item["field"] for item in error["details"]], error
    assert field in error["message"]
    assert _run_count(db) == 0


@pytest.mark.parametrize("body", [{}, {"spec": SPEC, "extra": 1}, [], {"spec": None}])
def test_malformed_bodies_are_422(client, db, submitter, body):
    assert_error(client.post("/api/v1/runs", json=body, headers=submitter), 422, "VALIDATION_ERROR")
    assert _run_count(db) == 0


def test_body_that_is_not_json_is_422(client, submitter):
    response = client.post("/api/v1/runs", content=b"\xff\xfe{", headers={**submitter, "content-type": "application/json"})
    assert_error(response, 422, "VALIDATION_ERROR")


@pytest.mark.parametrize(("field", "value"), [
    ("task.path", "/etc/passwd"),
    ("task.path", "../../secrets.jsonl"),
    ("model.checkpoint", "/tmp/../root/ckpt"),
    ("model.tokenizer", "/nonexistent/tokenizer.json"),
    ("output_dir", "/var/tmp/out"),
    ("checkpoint.dir", "/etc/cron.d"),
])
def test_paths_outside_the_allowed_roots_are_422_naming_the_field(client, db, submitter, field, value):
    section, _, leaf = field.rpartition(".")
    spec = {"name": "paths", "task": {"name": "gsm8k", "path": str(db_settings_data_file(client))}}
    if section:
        spec.setdefault(section, {})[leaf] = value
    else:
        spec[leaf] = value
    error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422, "PATH_NOT_ALLOWED")
    assert [item["field"] for item in error["details"]] == [f"spec.{field}"]
    assert _run_count(db) == 0


def db_settings_data_file(client) -> str:
    settings = client.app.state.settings
    return str(settings.data_roots[0] / "gsm8k.jsonl")


def test_paths_inside_the_roots_are_accepted(client, submitter):
    settings = client.app.state.settings
    spec = {"name": "inside", "task": {"name": "gsm8k", "path": str(settings.data_roots[0] / "sub" / "gsm8k.jsonl")},
            "model": {"checkpoint": str(settings.runs_root / "7-sft" / "model")}}
    assert client.post("/api/v1/runs", json={"spec": spec}, headers=submitter).status_code == 201


@pytest.mark.parametrize("task, field", [
    ({"name": "no-such-task"}, "spec.task.name"),
    ({"name": "arith", "reward": ["format", "no_such_reward"]}, "spec.task.reward.1"),
    ({"name": "arith", "reward": ["../../etc/passwd"]}, "spec.task.reward.0"),
    ({"name": "arith", "eval": {"reward": ["gsm8k", "no_such_reward"]}}, "spec.eval.reward.1"),
])
def test_unknown_task_and_reward_names_are_422_naming_the_field(client, db, submitter, task, field):
    task = dict(task)
    extra = {"eval": task.pop("eval")} if "eval" in task else {}
    error = assert_error(client.post("/api/v1/runs", json={"spec": {"name": "names", "task": task, **extra}},
                                     headers=submitter), 422, "UNKNOWN_NAME")
    assert [item["field"] for item in error["details"]] == [field]
    assert _run_count(db) == 0


@pytest.mark.parametrize(("lines", "needle"), [
    ('{"question": "How many?", "answer": "2+1=3\\n#### 3"}\n{"question": "And now?"}\n', "line 2: field 'answer'"),
    ('{"question": "How many?", "answer": "no final line"}\n', "line 1: field 'answer'"),
    ("not json\n", "line 1: not valid JSON"),
])
def test_a_malformed_data_file_the_server_can_see_is_422_naming_spec_task_path(client, db, submitter, lines, needle):
    data = Path(db_settings_data_file(client)).with_name("malformed.jsonl")
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(lines, encoding="utf-8")
    spec = {"name": "data", "task": {"name": "gsm8k", "path": str(data)}}
    error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422, "INVALID_DATA")
    assert [item["field"] for item in error["details"]] == ["spec.task.path"]
    assert needle in error["message"] and str(data) in error["message"]
    assert _run_count(db) == 0


def test_a_malformed_eval_file_is_422_naming_spec_eval_path(client, db, submitter):
    root = Path(db_settings_data_file(client)).parent
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text('{"question": "How many?", "answer": "#### 3"}\n', encoding="utf-8")
    (root / "test.jsonl").write_text('{"question": "How many?"}\n', encoding="utf-8")
    spec = {"name": "data", "task": {"name": "gsm8k", "path": str(root / "train.jsonl")},
            "eval": {"path": str(root / "test.jsonl"), "prompts": 2}}
    error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422, "INVALID_DATA")
    assert [item["field"] for item in error["details"]] == ["spec.eval.path"]
    assert _run_count(db) == 0


def test_a_well_formed_data_file_with_an_eval_block_is_accepted(client, submitter):
    root = Path(db_settings_data_file(client)).parent
    root.mkdir(parents=True, exist_ok=True)
    lines = "".join(f'{{"question": "What is {i}+1?", "answer": "{i}+1={i + 1}\\n#### {i + 1}"}}\n' for i in range(6))
    (root / "good.jsonl").write_text(lines, encoding="utf-8")
    spec = {"name": "data", "task": {"name": "gsm8k", "path": str(root / "good.jsonl")}, "eval": {"prompts": 2}}
    response = client.post("/api/v1/runs", json={"spec": spec}, headers=submitter)
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["eval"]["prompts"] == 2


def test_an_eval_block_outside_co_grpo_is_422_naming_it(client, db, submitter):
    spec = {"name": "sc-eval", "placement": {"mode": "sc", "hosts": 2}, "eval": {"prompts": 4}}
    error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422, "VALIDATION_ERROR")
    assert "eval applies to GRPO runs in CO mode only" in error["message"]
    assert _run_count(db) == 0


@pytest.mark.parametrize("reward", ["builtins:print", "shutil:rmtree", "pty:spawn", "my_rewards.module:score"])
def test_import_path_rewards_outside_the_allowlist_are_422(client, db, submitter, reward):
    spec = {"name": "names", "task": {"name": "countdown", "reward": ["countdown", reward]}}
    error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422, "UNKNOWN_NAME")
    assert [item["field"] for item in error["details"]] == ["spec.task.reward.1"]
    assert "not allowed by the operator" in error["details"][0]["message"]
    assert _run_count(db) == 0


def test_registered_and_allowed_reward_names_are_accepted(backend, submitter):
    from fastapi.testclient import TestClient

    from server.app import create_app

    # The same database, served under an operator's allowlist.
    settings = backend.settings.model_copy(update={"reward_modules": ["my_rewards", "tests.locojax"]})
    with TestClient(create_app(settings, plugins=False)) as client:
        spec = {"name": "names", "task": {"name": "countdown", "reward": ["countdown", "my_rewards.module:score"]}}
        assert client.post("/api/v1/runs", json={"spec": spec}, headers=submitter).status_code == 201
        spec["task"]["reward"] = ["my_rewardsx.module:score"]
        error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422, "UNKNOWN_NAME")
        assert error["details"][0]["field"] == "spec.task.reward.0"


def test_unknown_decision_is_422(client, db, submitter):
    spec = {**SPEC, "placement": {"mode": "co", "hosts": 2, "decision_id": 12345}}
    error = assert_error(client.post("/api/v1/runs", json={"spec": spec}, headers=submitter), 422, "DECISION_NOT_FOUND")
    assert error["details"][0]["field"] == "spec.placement.decision_id"
    assert _run_count(db) == 0


def test_idempotency_key_same_body_same_run(client, db, submitter):
    headers = {**submitter, "Idempotency-Key": "ci-build-42"}
    first = client.post("/api/v1/runs", json={"spec": SPEC}, headers=headers)
    again = client.post("/api/v1/runs", json={"spec": SPEC}, headers=headers)
    # The same spec spelled differently (defaults written out) is the same body after normalisation.
    spelled_out = client.post("/api/v1/runs", json={"spec": {**SPEC, "seed": 0}}, headers=headers)
    assert (first.status_code, again.status_code, spelled_out.status_code) == (201, 200, 200)
    assert first.json()["id"] == again.json()["id"] == spelled_out.json()["id"]
    assert _run_count(db) == 1


def test_idempotency_key_different_body_is_409(client, db, submitter):
    headers = {**submitter, "Idempotency-Key": "ci-build-43"}
    assert client.post("/api/v1/runs", json={"spec": SPEC}, headers=headers).status_code == 201
    error = assert_error(client.post("/api/v1/runs", json={"spec": {**SPEC, "steps": 11}}, headers=headers), 409,
                         "IDEMPOTENCY_KEY_REUSED")
    assert error["details"]["run_id"] >= 1
    assert _run_count(db) == 1


def test_concurrent_submissions_with_one_key_make_one_run(client, db, submitter):
    headers = {**submitter, "Idempotency-Key": "raced"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: client.post("/api/v1/runs", json={"spec": SPEC}, headers=headers), range(8)))
    assert sorted(r.status_code for r in responses) == [200] * 7 + [201]
    assert len({r.json()["id"] for r in responses}) == 1
    assert _run_count(db) == 1


@pytest.mark.parametrize("key", ["", "x" * 256, "has space", "tab\tkey"])
def test_bad_idempotency_keys_are_422(client, submitter, key):
    assert_error(client.post("/api/v1/runs", json={"spec": SPEC}, headers={**submitter, "Idempotency-Key": key}), 422)


def test_list_filters_and_cursor_pagination(client, db, submitter):
    ids = [insert_run(db, S.RUNNING if i % 3 == 0 else S.QUEUED, name=f"sweep-{i}") for i in range(25)]
    insert_run(db, S.FAILED, name="other_50%")
    seen, cursor = [], None
    while True:
        params = {"limit": 7, **({"cursor": cursor} if cursor else {})}
        page = client.get("/api/v1/runs", params=params, headers=submitter).json()
        seen += [run["id"] for run in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(ids + [ids[-1] + 1], reverse=True)  # newest first, every run exactly once

    running = client.get("/api/v1/runs", params={"status": "RUNNING"}, headers=submitter).json()["data"]
    assert {run["id"] for run in running} == {ids[i] for i in range(0, 25, 3)}
    both = client.get("/api/v1/runs", params=[("status", "RUNNING"), ("status", "FAILED")], headers=submitter).json()
    assert len(both["data"]) == 10 and both["next_cursor"] is None  # 9 RUNNING + 1 FAILED fill one default page
    named = client.get("/api/v1/runs", params={"name": "SWEEP-2"}, headers=submitter).json()["data"]
    assert {run["name"] for run in named} == {"sweep-2", "sweep-20", "sweep-21", "sweep-22", "sweep-23", "sweep-24"}
    # LIKE wildcards in the filter are literal characters
    assert [run["name"] for run in client.get("/api/v1/runs", params={"name": "_50%"}, headers=submitter).json()["data"]] \
        == ["other_50%"]
    assert client.get("/api/v1/runs", params={"name": "%"}, headers=submitter).json()["data"][0]["name"] == "other_50%"


def test_page_size_is_clamped_to_the_server_maximum(client, db, submitter):
    for i in range(25):
        insert_run(db, name=f"r{i}")
    page = client.get("/api/v1/runs", params={"limit": 1000}, headers=submitter).json()
    assert len(page["data"]) == 20 and page["next_cursor"]


@pytest.mark.parametrize("cursor", ["garbage", "djE6LTE", "!!!", "djI6MTA"])
def test_bad_cursor_is_422(client, submitter, cursor):
    error = assert_error(client.get("/api/v1/runs", params={"cursor": cursor}, headers=submitter), 422, "INVALID_CURSOR")
    assert error["details"][0]["field"] == "cursor"


@pytest.mark.parametrize("params", [{"status": "DONE"}, {"limit": 0}, {"limit": -5}])
def test_bad_list_parameters_are_422(client, submitter, params):
    assert_error(client.get("/api/v1/runs", params=params, headers=submitter), 422, "VALIDATION_ERROR")


def test_unknown_run_is_404_everywhere(client, admin):
    for method, path in [("GET", "/api/v1/runs/999"), ("POST", "/api/v1/runs/999/cancel"),
                         ("POST", "/api/v1/runs/999/resume"), ("DELETE", "/api/v1/runs/999")]:
        assert_error(client.request(method, path, headers=admin), 404, "RUN_NOT_FOUND")


@pytest.mark.parametrize("run_id", ["0", "-1", "2147483648", "99999999999999999999", "abc"])
def test_out_of_range_ids_are_422_not_500(client, admin, run_id):
    assert_error(client.get(f"/api/v1/runs/{run_id}", headers=admin), 422)


# --- cancel / resume / delete from every state ------------------------------------------------------

CANCEL_OUTCOME = {
    S.QUEUED: S.CANCELLED, S.STARTING: S.CANCELLING, S.RUNNING: S.CANCELLING, S.RECOVERING: S.CANCELLING,
    S.CANCELLING: S.CANCELLING,
}


@pytest.mark.parametrize("state", list(RunStatus), ids=lambda s: s.value)
def test_cancel_from_every_state(client, db, submitter, admin, state):
    run_id = insert_run(db, state)  # no owner: only an admin may act on it (ownership: test_isolation)
    response = client.post(f"/api/v1/runs/{run_id}/cancel", headers=admin)
    if state in TERMINAL_STATES:
        error = assert_error(response, 409, "ILLEGAL_TRANSITION")
        assert error["details"]["from"] == state.value
        assert client.get(f"/api/v1/runs/{run_id}", headers=submitter).json()["status"] == state.value
        return
    assert response.status_code == 202, response.text
    run = response.json()
    assert run["status"] == CANCEL_OUTCOME[state].value
    assert run["cancel_requested"] == (CANCEL_OUTCOME[state] is S.CANCELLING)
    if state is S.QUEUED:
        assert "before it started" in run["status_reason"] and run["finished_at"]


@pytest.mark.parametrize("state", list(RunStatus), ids=lambda s: s.value)
def test_resume_from_every_state(client, db, submitter, admin, state):
    run_id = insert_run(db, state, last_checkpoint_step=50, attempt=0, restarts=2)
    response = client.post(f"/api/v1/runs/{run_id}/resume", headers=admin)
    if state not in (S.FAILED, S.CANCELLED):
        assert_error(response, 409, "ILLEGAL_TRANSITION")
        assert client.get(f"/api/v1/runs/{run_id}", headers=submitter).json()["status"] == state.value
        return
    assert response.status_code == 202, response.text
    run = response.json()
    assert (run["status"], run["attempt"], run["restarts"], run["finished_at"]) == ("QUEUED", 1, 0, None)
    assert "step 50" in run["status_reason"]
    assert run["last_checkpoint_step"] == 50


@pytest.mark.parametrize("state", list(RunStatus), ids=lambda s: s.value)
def test_delete_only_finished_runs(client, db, submitter, worker, admin, state):
    run_id = insert_run(db, S.RUNNING, placed_on="h0")
    posted = client.post(f"/api/v1/runs/{run_id}/metrics", json={"rows": [{"step": 0, "values": {"a": 1.0}}],
                                                                 "attempt": 0}, headers=worker)
    assert posted.status_code == 200, posted.text
    with db.write_session() as session:
        session.execute(update(Run).where(Run.id == run_id).values(status=state))
        session.commit()
    response = client.delete(f"/api/v1/runs/{run_id}", headers=admin)
    if state not in TERMINAL_STATES:
        assert_error(response, 409, "RUN_NOT_TERMINAL")
        assert client.get(f"/api/v1/runs/{run_id}", headers=submitter).status_code == 200
        return
    assert response.status_code == 204 and response.content == b""
    assert_error(client.get(f"/api/v1/runs/{run_id}", headers=submitter), 404, "RUN_NOT_FOUND")
    with db.read_session() as session:
        assert session.scalar(select(func.count()).select_from(StepMetric)) == 0


def test_resume_then_cancel_then_resume_again(client, db, admin):
    run_id = insert_run(db, S.FAILED)
    assert client.post(f"/api/v1/runs/{run_id}/resume", headers=admin).json()["attempt"] == 1
    assert client.post(f"/api/v1/runs/{run_id}/cancel", headers=admin).json()["status"] == "CANCELLED"
    assert client.post(f"/api/v1/runs/{run_id}/resume", headers=admin).json()["attempt"] == 2


# --- worker reports ---------------------------------------------------------------------------------

def test_worker_drives_a_run_to_success(client, submitter, worker, admin):
    run_id = client.post("/api/v1/runs", json={"spec": SPEC}, headers=submitter).json()["id"]
    for state in ("STARTING", "RUNNING"):
        assert client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": state}, headers=admin).json()["status"] == state
    # a retried report of the current state is a no-op, not an error
    again = client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": "RUNNING"}, headers=admin)
    assert again.status_code == 200 and again.json()["status"] == "RUNNING"
    for step in (25, 10, 50):  # out of order: only moves forward
        client.post(f"/api/v1/runs/{run_id}/checkpoints", json={"step": step, "attempt": 0}, headers=admin)
    done = client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": "SUCCEEDED", "reason": "10 steps"}, headers=admin)
    assert done.json()["status"] == "SUCCEEDED" and done.json()["last_checkpoint_step"] == 50
    messages = [e["message"] for e in client.get(f"/api/v1/runs/{run_id}/events", headers=submitter).json()["data"]]
    assert messages[1:] == ["QUEUED -> STARTING", "STARTING -> RUNNING", "checkpoint saved at step 25",
                            "checkpoint saved at step 50", "RUNNING -> SUCCEEDED: 10 steps"]


@pytest.mark.parametrize(("state", "target"), [
    (S.QUEUED, S.RUNNING), (S.QUEUED, S.SUCCEEDED), (S.RUNNING, S.QUEUED), (S.SUCCEEDED, S.RUNNING),
    (S.FAILED, S.QUEUED), (S.CANCELLED, S.RUNNING), (S.CANCELLING, S.RUNNING), (S.RECOVERING, S.SUCCEEDED),
])
def test_illegal_transitions_by_an_admin_are_409_and_not_written(client, db, state, target, admin):
    """`/transitions` is admin-only (workers report process rows instead); even an admin cannot make an
    illegal move."""
    run_id = insert_run(db, state)
    error = assert_error(client.post(f"/api/v1/runs/{run_id}/transitions", json={"to": target.value}, headers=admin),
                         409, "ILLEGAL_TRANSITION")
    assert (error["details"]["from"], error["details"]["to"]) == (state.value, target.value)
    with db.read_session() as session:
        assert session.get(Run, run_id).status == state


def test_an_admin_transition_with_a_stale_expectation_is_409(client, db, admin):
    run_id = insert_run(db, S.CANCELLING)
    body = {"to": "FAILED", "expected": "RUNNING"}
    assert_error(client.post(f"/api/v1/runs/{run_id}/transitions", json=body, headers=admin), 409, "RUN_STATE_CHANGED")


def test_run_host_processes(client, db, submitter, worker):
    run_id = insert_run(db, S.STARTING, attempt=3)
    with db.write_session() as session:  # what the scheduler does when it starts the attempt
        for index in (0, 1):
            session.add(RunHost(run_id=run_id, attempt=3, process_index=index, host_name=f"h{index}",
                                role=HostRole.CO, status=HostProcessStatus.STARTING))
        session.commit()
    for index in (1, 0):
        body = {"host_name": f"h{index}", "role": "co", "status": "STARTING", "pid": 1000 + index, "attempt": 3}
        assert client.put(f"/api/v1/runs/{run_id}/hosts/{index}", json=body, headers=worker).status_code == 200
    changes = {"host_name": "h0", "role": "co", "status": "FAILED", "exit_code": -9, "attempt": 3}
    row = client.put(f"/api/v1/runs/{run_id}/hosts/0", json=changes, headers=worker).json()
    assert (row["status"], row["exit_code"], row["pid"], row["attempt"]) == ("FAILED", -9, 1000, 3)
    # A failed process sends the run to RECOVERING, a new attempt (the lifecycle, tested in test_scheduling).
    run = client.get(f"/api/v1/runs/{run_id}", headers=submitter).json()
    assert (run["status"], run["attempt"]) == ("RECOVERING", 4)
    rows = client.get(f"/api/v1/runs/{run_id}/hosts", params={"attempt": 3}, headers=submitter).json()["data"]
    assert [(r["process_index"], r["host_name"], r["status"]) for r in rows] == [(0, "h0", "FAILED"), (1, "h1", "STARTING")]
    assert client.get(f"/api/v1/runs/{run_id}/hosts", headers=submitter).json()["data"] == []
    assert client.get(f"/api/v1/runs/{run_id}/hosts", params={"attempt": 2}, headers=submitter).json()["data"] == []
    bad = {"host_name": "h0", "role": "mystery", "status": "RUNNING", "attempt": 4}
    assert_error(client.put(f"/api/v1/runs/{run_id}/hosts/0", json=bad, headers=worker), 422)


@pytest.mark.parametrize(("method", "path", "kwargs"), [
    ("POST", "/api/v1/runs", {"json": {"spec": {"name": "nul", "task": {"name": "gsm8k", "path": "data/a\u0000.jsonl"}}}}),
    ("POST", "/api/v1/hosts", {"json": {"name": "h0", "device_kind": "cpu\u0000"}}),
    ("POST", "/api/v1/tokens", {"json": {"name": "\u0000", "scopes": ["submit"]}}),
    ("GET", "/api/v1/runs", {"params": {"name": "a\x00b"}}),
])
def test_nul_characters_are_422_on_every_backend(client, db, admin, method, path, kwargs):
    # PostgreSQL cannot store NUL in text or JSONB; SQLite could, but both backends must behave alike.
    assert_error(client.request(method, path, headers=admin, **kwargs), 422, "VALIDATION_ERROR")
    assert _run_count(db) == 0


def test_an_escaped_backslash_before_u0000_is_ordinary_text(client, submitter):
    spec = {"name": "escaped", "task": {"name": "gsm8k", "path": str(client.app.state.settings.data_roots[0]) + "/\\u0000"}}
    response = client.post("/api/v1/runs", json={"spec": spec}, headers=submitter)
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["task"]["path"].endswith("\\u0000")


def test_oversize_and_deeply_nested_bodies_are_refused_in_the_error_shape(backend, submitter):
    from fastapi.testclient import TestClient

    from server.app import create_app

    small = create_app(backend.settings.model_copy(update={"max_body_bytes": 10_000}), plugins=False)
    try:
        client = TestClient(small)
        headers = {**submitter, "content-type": "application/json"}
        big = b'{"spec": {"name": "' + b"x" * 20_000 + b'"}}'
        assert_error(client.post("/api/v1/runs", content=big, headers=headers), 413, "PAYLOAD_TOO_LARGE")

        def chunked():  # no Content-Length: counted while it streams
            yield b'{"spec": {"name": "'
            for _ in range(10):
                yield b"x" * 2_000
            yield b'"}}'

        assert_error(client.post("/api/v1/runs", content=chunked(), headers=headers), 413, "PAYLOAD_TOO_LARGE")
        deep = b'{"spec": ' + b"[" * 3_000 + b"]" * 3_000 + b"}"
        error = assert_error(client.post("/api/v1/runs", content=deep, headers=headers), 422, "VALIDATION_ERROR")
        assert error["message"] == "body: nested too deeply"
        latin1 = '{"spec": {"name": "caf\u00e9"}}'.encode("latin-1")
        error = assert_error(client.post("/api/v1/runs", content=latin1, headers=headers), 422, "VALIDATION_ERROR")
        assert error["message"].startswith("body: not UTF-8")
        assert _run_count(backend.db) == 0
    finally:
        small.state.db.dispose()


@pytest.mark.parametrize("override, field", [
    ({"rollout": {"max_new_tokens": 32_769}}, "spec.rollout.max_new_tokens"),
    ({"rollout": {"max_prompt_tokens": 32_769}}, "spec.rollout.max_prompt_tokens"),
    ({"checkpoint": {"keep": 101}}, "spec.checkpoint.keep"),
    ({"max_restarts": 11}, "spec.max_restarts"),
    ({"placement": {"mode": "da", "hosts": 2, "ray_address": "attacker.example:6379"}}, "spec.placement.ray_address"),
])
def test_limits_a_real_run_would_never_pass_are_422_naming_the_field(client, db, submitter, override, field):
    error = assert_error(client.post("/api/v1/runs", json={"spec": {"name": "limits", **override}},
                                     headers=submitter), 422)
    assert [item["field"] for item in error["details"]] == [field]
    assert _run_count(db) == 0


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_json_bodies_that_are_not_utf8_are_refused(client, db, submitter, encoding):
    body = json.dumps({"spec": {"name": "wide"}}).encode(encoding)
    response = client.post("/api/v1/runs", content=body, headers={**submitter, "Content-Type": "application/json"})
    assert 400 <= response.status_code < 500
    assert response.json()["error"]["details"][0]["field"] == "body"
    assert _run_count(db) == 0


def test_invalid_utf8_bytes_in_a_json_body_are_refused(client, db, submitter):
    response = client.post("/api/v1/runs", content=b'{"spec": {"name": "\xff\xfe"}}',
                           headers={**submitter, "Content-Type": "application/json"})
    assert_error(response, 422, "VALIDATION_ERROR")
    assert _run_count(db) == 0
