"""Isolation (issue 17) against the live stack: what a second tenant, a worker token of another host, or
a stale attempt might try, each sent for real to the running API (PostgreSQL, Redis, Celery workers).

Each probe records what was sent, what came back and whether it was blocked (the `Attacks` log of
tests/e2e/attacks.py). Groups:
  ownership     another submitter cancels, resumes, deletes a run (one submitted through the API, one
                through the dashboard's form), or replays its idempotency key
  hosts         a worker token of another host registers, heartbeats or reports as a plane host; a second
                worker instance takes over a live host (with a fresh instance, with the one readers see, or
                after renaming the live one with a heartbeat); a forged process row; `/transitions` by hand
  attempts      metrics, events and checkpoints of a stale attempt or for a finished run; metrics from a
                process that does not write them; a forged source
  directories   a spec naming a run directory (its own, the root, another run's) or reading outside the
                data roots (relative, through a symlink) or another run's checkpoints, metrics or
                `.control/`; a `checkpoint.dir` forged into a stored spec (the host refuses it)
  scheduling    an unsatisfiable run (512 hosts) is held with its reason while a younger run starts
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any

import httpx

from locojax.client import TERMINAL, ApiClientError
from tests.e2e.attacks import Attacks
from tests.e2e.attacks import _error_field as _field
from tests.e2e.helpers import tiny_spec, wait_final, wait_until
from tests.e2e.infra import Stack
from tests.e2e.outcome import outcome
from tests.e2e.security import _login


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _refused(response: httpx.Response, status: int, code: str | None = None) -> bool:
    return response.status_code == status and (code is None or _code(response) == code)


def _status(stack: Stack, run_id: int) -> str | None:
    rows = stack.sql("SELECT status FROM runs WHERE id = :id", id=run_id)
    return str(rows[0][0]) if rows else None


def _token(http: httpx.Client, admin: dict[str, str], name: str, scopes: list[str], **extra: Any) -> dict[str, str]:
    made = http.post("/api/v1/tokens", json={"name": name, "scopes": scopes, **extra}, headers=admin)
    made.raise_for_status()
    return _bearer(made.json()["token"])


def _unplaceable(stack: Stack, name: str) -> dict[str, Any]:
    """A run that never starts: more hosts than the plane has."""
    return tiny_spec(name, hosts=len(stack.plane.host_names) + 1, steps=1)


def _ownership(stack: Stack, http: httpx.Client, owner: dict[str, str], other: dict[str, str], log: Attacks) -> int:
    run = http.post("/api/v1/runs", json={"spec": _unplaceable(stack, f"owned-{secrets.token_hex(2)}")},
                    headers={**owner, "Idempotency-Key": "iso-key-1"}).json()
    run_id = run["id"]
    response = http.post(f"/api/v1/runs/{run_id}/cancel", headers=other)
    log.record("another submitter cancels a run", f"POST /api/v1/runs/{run_id}/cancel (other token)", response,
               _refused(response, 403, "RUN_NOT_OWNED") and _status(stack, run_id) == "QUEUED")
    http.post(f"/api/v1/runs/{run_id}/cancel", headers=owner).raise_for_status()
    response = http.post(f"/api/v1/runs/{run_id}/resume", headers=other)
    log.record("another submitter resumes a run", f"POST /api/v1/runs/{run_id}/resume (other token)", response,
               _refused(response, 403, "RUN_NOT_OWNED") and _status(stack, run_id) == "CANCELLED")
    response = http.delete(f"/api/v1/runs/{run_id}", headers=other)
    log.record("another submitter deletes a run", f"DELETE /api/v1/runs/{run_id} (other token)", response,
               _refused(response, 403, "RUN_NOT_OWNED") and _status(stack, run_id) == "CANCELLED")
    replay = http.post("/api/v1/runs", json={"spec": _unplaceable(stack, run["name"])},
                       headers={**other, "Idempotency-Key": "iso-key-1"})
    theirs = replay.json().get("id") if replay.status_code in (200, 201) else None
    log.record("another token replays an idempotency key", "POST /api/v1/runs Idempotency-Key=iso-key-1 (other token)",
               f"{replay.status_code} run {theirs} (the owner's is {run_id})", replay.status_code == 201
               and theirs not in (None, run_id))
    if theirs is not None:
        http.post(f"/api/v1/runs/{theirs}/cancel", headers=other)
    return run_id


def _dashboard_ownership(stack: Stack, http: httpx.Client, owner: dict[str, str], other: dict[str, str],
                         log: Attacks) -> None:
    """A run submitted through the dashboard's form belongs to its submitter as one submitted through the
    API does: another token may not cancel it, its submitter may (it was once stored with no owner)."""
    browser, csrf = _login(stack, owner["Authorization"].split(" ", 1)[1])
    try:
        form = {"csrf_token": csrf, "name": f"from-form-{secrets.token_hex(2)}", "preset": "tiny", "task": "arith",
                "steps": "1", "hosts": str(len(stack.plane.host_names) + 1)}  # never placed
        submitted = browser.post("/runs/new", data=form)
        if submitted.status_code != 303:
            log.record("another submitter cancels a run submitted from the dashboard", "POST /runs/new",
                       f"the form was refused: {submitted.status_code}", False)
            return
        run_id = int(submitted.headers["location"].rsplit("/", 1)[1])
        response = http.post(f"/api/v1/runs/{run_id}/cancel", headers=other)
        refused = _refused(response, 403, "RUN_NOT_OWNED") and _status(stack, run_id) == "QUEUED"
        own = browser.post(f"/runs/{run_id}/cancel", data={"csrf_token": csrf})
        log.record("another submitter cancels a run submitted from the dashboard",
                   f"POST /runs/new (tenant a's session), POST /api/v1/runs/{run_id}/cancel (tenant b), "
                   f"POST /runs/{run_id}/cancel (tenant a's session)",
                   f"tenant b: {response.status_code} {_code(response)}; tenant a: {own.status_code}, run "
                   f"{_status(stack, run_id)}", refused and own.status_code == 303
                   and _status(stack, run_id) == "CANCELLED")
    finally:
        browser.close()


def _registered_instance(stack: Stack, host: str) -> str | None:
    rows = stack.sql("SELECT info FROM hosts WHERE name = :name", name=host)
    return (rows[0][0] or {}).get("instance") if rows else None


def _hosts(stack: Stack, http: httpx.Client, admin: dict[str, str], submit: dict[str, str], log: Attacks) -> None:
    host = stack.plane.host_names[0]
    worker = _bearer(stack.plane.worker_token)
    intruder = _token(http, admin, f"intruder-{secrets.token_hex(2)}", ["worker"], hosts="intruder-*")
    response = http.post("/api/v1/tokens", json={"name": "unbound", "scopes": ["worker"]}, headers=admin)
    log.record("a worker token bound to no host", "POST /api/v1/tokens scopes=[worker], no hosts", response,
               response.status_code == 422 and _field(response) == "hosts")

    before = stack.sql("SELECT info, last_heartbeat FROM hosts WHERE name = :name", name=host)
    response = http.post("/api/v1/hosts", json={"name": host, "info": {"instance": "intruder"}}, headers=intruder)
    log.record("a worker token of another host registers a plane host", f"POST /api/v1/hosts name={host} "
               "(token bound to intruder-*)", response, _refused(response, 403, "HOST_NOT_BOUND"))
    response = http.post(f"/api/v1/hosts/{host}/heartbeat", json={"info": {"owned": True}}, headers=intruder)
    after = stack.sql("SELECT info FROM hosts WHERE name = :name", name=host)
    log.record("a worker token of another host heartbeats a plane host", f"POST /api/v1/hosts/{host}/heartbeat",
               response, _refused(response, 403, "HOST_NOT_BOUND") and after[0][0] == before[0][0])
    response = http.post("/api/v1/hosts", json={"name": "local9", "info": {}}, headers=intruder)
    log.record("a fake host in the plane's name space", "POST /api/v1/hosts name=local9 (token bound to intruder-*)",
               response, _refused(response, 403, "HOST_NOT_BOUND")
               and not stack.sql("SELECT 1 FROM hosts WHERE name = 'local9'"))
    response = http.post("/api/v1/hosts", json={"name": host, "info": {"instance": secrets.token_hex(8)}},
                         headers=worker)
    log.record("a second worker instance takes over a live host", f"POST /api/v1/hosts name={host} new instance "
               "(the plane's own worker token)", response, _refused(response, 409, "HOST_IN_USE"))
    # The guard trusts the worker's instance nonce: a reader must not learn it, a heartbeat must not change it.
    live_instance = _registered_instance(stack, host)
    shown = http.get(f"/api/v1/hosts/{host}", headers=submit).json().get("info", {}).get("instance")
    response = http.post("/api/v1/hosts", json={"name": host, "info": {"instance": shown} if shown else {}},
                         headers=worker)
    log.record("a worker token re-registers a live host with the instance readers see",
               f"GET /api/v1/hosts/{host} (submit token): instance {'shown' if shown else 'not shown'}; "
               f"POST /api/v1/hosts name={host} with it", response,
               shown is None and _refused(response, 409, "HOST_IN_USE"))
    renamed = f"renamed-{secrets.token_hex(4)}"
    response = http.post(f"/api/v1/hosts/{host}/heartbeat", json={"info": {"instance": renamed}}, headers=worker)
    log.record("a heartbeat renames a live host's worker", f"POST /api/v1/hosts/{host}/heartbeat "
               f"info.instance={renamed}", response, _refused(response, 409, "HOST_IN_USE")
               and _registered_instance(stack, host) == live_instance)
    response = http.post("/api/v1/hosts", json={"name": host, "info": {"instance": renamed}}, headers=worker)
    log.record("a worker registers a live host under the name a heartbeat tried to give it",
               f"POST /api/v1/hosts name={host} info.instance={renamed}", response,
               _refused(response, 409, "HOST_IN_USE") and _registered_instance(stack, host) == live_instance)

    for name, token in (("worker", worker), ("submit", submit)):
        queued = http.post("/api/v1/runs", json={"spec": _unplaceable(stack, f"moved-{secrets.token_hex(2)}")},
                           headers=submit).json()["id"]
        response = http.post(f"/api/v1/runs/{queued}/transitions", json={"to": "STARTING"}, headers=token)
        log.record(f"a {name} token moves a run by hand", f"POST /api/v1/runs/{queued}/transitions to=STARTING",
                   response, _refused(response, 403, "AUTH_FORBIDDEN") and _status(stack, queued) == "QUEUED")
        http.post(f"/api/v1/runs/{queued}/cancel", headers=submit)


def _forged_row_and_backfill(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    """The old wedge (a forged process row for a QUEUED run failed every later tick) and strict FIFO behind
    an unsatisfiable run: a 512-host run is held with its reason, and a younger 1-host run still starts."""
    worker = _bearer(stack.plane.worker_token)
    spec = tiny_spec(f"huge-{secrets.token_hex(2)}", hosts=512, steps=1)
    spec["rollout"] = {**spec["rollout"], "prompts_per_step": 512}  # one prompt per host
    response = http.post("/api/v1/runs", json={"spec": spec}, headers=submit)
    response.raise_for_status()
    huge = response.json()["id"]
    # Forged on the run that stays QUEUED (no 512 hosts here): the 1-host run below may be placed within
    # a scheduler tick of its submission, and then its host's worker may rightly report its process (a CI
    # run forged that row after the placement and got 200). The small run starting after it is the check
    # that the forged row wedged nothing.
    forged = {"host_name": stack.plane.host_names[0], "role": "co", "status": "EXITED", "attempt": 0}
    response = http.put(f"/api/v1/runs/{huge}/hosts/0", json=forged, headers=worker)
    log.record("a forged process row for a queued run", f"PUT /api/v1/runs/{huge}/hosts/0 status=EXITED", response,
               _refused(response, 409, "PROCESS_NOT_PLACED") and _status(stack, huge) == "QUEUED")
    small = http.post("/api/v1/runs", json={"spec": tiny_spec(f"small-{secrets.token_hex(2)}", hosts=1, steps=1)},
                      headers=submit).json()["id"]
    with stack.client() as api:
        try:
            started = wait_until(lambda: api.get_run(small)["status"] != "QUEUED", 60, "the small run to start")
        except AssertionError:
            started = False
        reason = api.get_run(huge)["status_reason"] or ""
        log.record("a 512-host run ahead of a 1-host run", f"runs {huge} (512 hosts) then {small} (1 host)",
                   f"small started: {bool(started)}; huge: {_status(stack, huge)} ({reason[:120]})",
                   bool(started) and _status(stack, huge) == "QUEUED" and "placement.hosts is 512" in reason)
        for run_id in (small, huge):
            try:
                api.cancel_run(run_id)
            except ApiClientError as error:
                # The 1-step small run may finish before it is cancelled (a CI run saw SUCCEEDED): only a
                # run already in a final state may refuse the cancel.
                if not (error.code == "ILLEGAL_TRANSITION" and api.get_run(run_id)["status"] in TERMINAL):
                    raise
        wait_final(api, small, 120)


def _attempts(stack: Stack, http: httpx.Client, owned: int, owner: dict[str, str], log: Attacks) -> None:
    worker = _bearer(stack.plane.worker_token)
    host = stack.plane.host_names[0]
    finished = {"rows": [{"step": 0, "host": -1, "values": {"loss": 1.0}}], "attempt": 0}
    # Its attempt-0 process 0 was placed on a plane host, so only the RUN_FINISHED check stands in the way.
    stack.sql("INSERT INTO run_hosts (run_id, attempt, process_index, host_name, role, status, updated_at) "
              "VALUES (:id, 0, 0, :host, 'co', 'EXITED', now())", id=owned, host=host)
    response = http.post(f"/api/v1/runs/{owned}/metrics", json={**finished, "host_name": host}, headers=worker)
    stored = stack.sql("SELECT COUNT(*) FROM step_metrics WHERE run_id = :id", id=owned)[0][0]
    log.record("metrics for a finished run", f"POST /api/v1/runs/{owned}/metrics attempt=0 host_name={host} "
               "(run CANCELLED; its process 0 was placed there)", response,
               _refused(response, 409, "RUN_FINISHED") and stored == 0)
    # A live run at attempt 1 whose process 0 is placed on a plane host: the attempt-0 relay is stale.
    resumed = http.post(f"/api/v1/runs/{owned}/resume", headers=owner).json()
    stack.sql("INSERT INTO run_hosts (run_id, attempt, process_index, host_name, role, status, updated_at) "
              "VALUES (:id, :attempt, 0, :host, 'co', 'RUNNING', now())", id=owned, attempt=resumed["attempt"],
              host=host)
    rows_before = stack.sql("SELECT COUNT(*) FROM step_metrics WHERE run_id = :id", id=owned)[0][0]
    for route, body in [("metrics", {"rows": [{"step": 5, "host": -1, "values": {"loss": 9.0}}]}),
                        ("events", {"events": [{"message": "from the killed attempt", "seq": 1}]}),
                        ("checkpoints", {"step": 5})]:
        response = http.post(f"/api/v1/runs/{owned}/{route}", json={**body, "attempt": resumed["attempt"] - 1},
                             headers=worker)
        log.record(f"{route} of a stale attempt", f"POST /api/v1/runs/{owned}/{route} attempt={resumed['attempt'] - 1} "
                   f"(current {resumed['attempt']})", response, _refused(response, 409, "STALE_ATTEMPT"))
    response = http.post(f"/api/v1/runs/{owned}/events", json={"events": [{"message": "x", "source": "scheduler"}],
                                                                "attempt": resumed["attempt"]}, headers=worker)
    log.record("an event in the scheduler's name", f"POST /api/v1/runs/{owned}/events source=scheduler", response,
               response.status_code == 422 and (_field(response) or "").startswith("events.0"))
    other_host = stack.plane.host_names[1]
    response = http.post(f"/api/v1/runs/{owned}/metrics", json={**finished, "attempt": resumed["attempt"],
                                                                 "host_name": other_host}, headers=worker)
    log.record("metrics as a host without a process in the run", f"POST /api/v1/runs/{owned}/metrics "
               f"host_name={other_host}", response, _refused(response, 403, "HOST_NOT_PLACED"))
    rows_after = stack.sql("SELECT COUNT(*) FROM step_metrics WHERE run_id = :id", id=owned)[0][0]
    checkpoint = stack.sql("SELECT last_checkpoint_step FROM runs WHERE id = :id", id=owned)[0][0]
    log.record("nothing of the stale reports was stored", f"run {owned}: step_metrics rows, last_checkpoint_step",
               f"rows {rows_before} -> {rows_after}, checkpoint {checkpoint}", rows_after == rows_before
               and checkpoint is None)
    http.post(f"/api/v1/runs/{owned}/cancel", headers=owner)


def _metrics_from_another_process(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    """Process 0 writes metrics.jsonl (every host's rows and the aggregate) and its host relays it; the host
    of process 1 has none to relay, so its rows, for any host index, are forged."""
    worker = _bearer(stack.plane.worker_token)
    zero_host, one_host = stack.plane.host_names[:2]
    run_id = http.post("/api/v1/runs", json={"spec": _unplaceable(stack, f"two-proc-{secrets.token_hex(2)}")},
                       headers=submit).json()["id"]
    # Placed as the scheduler would, and already ended: nothing is left for the reconciler to stop.
    for index, host in ((0, zero_host), (1, one_host)):
        stack.sql("INSERT INTO run_hosts (run_id, attempt, process_index, host_name, role, status, updated_at) "
                  "VALUES (:id, 0, :index, :host, 'co', 'EXITED', now())", id=run_id, index=index, host=host)
    rows = [{"step": 0, "host": index, "values": {"loss": 6.0}} for index in (1, 0, -1)]
    response = http.post(f"/api/v1/runs/{run_id}/metrics", json={"rows": rows, "attempt": 0, "host_name": one_host},
                         headers=worker)
    stored = stack.sql("SELECT COUNT(*) FROM step_metrics WHERE run_id = :id", id=run_id)[0][0]
    log.record("metrics from the host of process 1 (for hosts 1, 0 and the aggregate)",
               f"POST /api/v1/runs/{run_id}/metrics host_name={one_host} rows for host 1, 0, -1", response,
               _refused(response, 403, "NOT_METRICS_PROCESS") and stored == 0)
    http.post(f"/api/v1/runs/{run_id}/cancel", headers=submit)


def _forged_checkpoint_dir(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    """A stored spec changed behind the API's back to set `checkpoint.dir` (the API refuses it): the host
    refuses to start the run, saying why, and writes nothing, there or in the run directory."""
    response = http.post("/api/v1/runs", json={"spec": _unplaceable(stack, f"forged-ckpt-{secrets.token_hex(2)}")},
                         headers=submit)
    response.raise_for_status()
    run = response.json()
    target = stack.work / f"forged-checkpoints-{secrets.token_hex(2)}"
    forged = {**tiny_spec(run["name"], hosts=1, steps=1, every=1), "max_restarts": 0}
    forged["checkpoint"] = {**forged["checkpoint"], "dir": str(target)}
    stack.sql("UPDATE runs SET spec = CAST(:spec AS JSONB), hosts_needed = 1, max_restarts = 0 WHERE id = :id",
              spec=json.dumps(forged), id=run["id"])
    with stack.client() as api:
        final = wait_final(api, run["id"], timeout_s=120)
        events = api.events(run["id"])["data"]
    said = [e["message"] for e in events if "spec.checkpoint.dir" in e["message"]]
    run_dir = stack.settings.runs_root / f"{run['id']}-{run['name']}"
    log.record("checkpoint.dir forged into a stored spec", f"UPDATE runs SET spec.checkpoint.dir={target} for run "
               f"{run['id']}", f"{final['status']}: {(said or [final.get('status_reason') or ''])[0][:200]}; "
               f"written: {target.exists() or run_dir.exists()}",
               final["status"] == "FAILED" and bool(said) and not target.exists() and not run_dir.exists())


def _directories(stack: Stack, http: httpx.Client, submit: dict[str, str], log: Attacks) -> None:
    runs, data = stack.settings.runs_root, stack.settings.data_roots[0]
    other = stack.sql("SELECT id, name FROM runs ORDER BY id LIMIT 1")
    other_dir = runs / f"{other[0][0]}-{other[0][1]}" if other else runs / "1-other"
    secret = stack.work / "outside-secret.jsonl"
    secret.write_text('{"question": "q", "answer": "#### 1"}\n')
    link = data / f"link-{secrets.token_hex(2)}.jsonl"
    os.symlink(secret, link)
    try:
        for name, changes, field in [
            ("output_dir inside runs_root", {"output_dir": str(runs / "mine")}, "spec.output_dir"),
            ("output_dir = runs_root itself", {"output_dir": str(runs)}, "spec.output_dir"),
            ("output_dir = another run's directory", {"output_dir": str(other_dir)}, "spec.output_dir"),
            ("checkpoint.dir inside another run", {"checkpoint": {"dir": str(other_dir / "checkpoints")}},
             "spec.checkpoint.dir"),
            ("a relative data path", {"task": {"name": "gsm8k", "path": "data/gsm8k.jsonl"}}, "spec.task.path"),
            ("a data path through a symlink out of the root", {"task": {"name": "gsm8k", "path": str(link)}},
             "spec.task.path"),
            ("another run's checkpoints as the model",
             {"model": {"preset": "tiny", "checkpoint": str(other_dir / "checkpoints")}}, "spec.model.checkpoint"),
            ("another run's metrics as the task data",
             {"task": {"name": "gsm8k", "path": str(other_dir / "metrics.jsonl")}}, "spec.task.path"),
            ("another run's attempt secret as the tokenizer",
             {"model": {"preset": "tiny", "tokenizer": str(other_dir / ".control" / "secret-attempt0-host0")}},
             "spec.model.tokenizer"),
            ("out of another run's export into its .control",
             {"model": {"preset": "tiny", "checkpoint": str(other_dir / "model" / ".." / ".control")}},
             "spec.model.checkpoint"),
        ]:
            spec = {**tiny_spec(f"dir-{secrets.token_hex(2)}", hosts=1, steps=1), **changes}
            response = http.post("/api/v1/runs", json={"spec": spec}, headers=submit)
            log.record(name, f"POST /api/v1/runs {json.dumps(changes)[:200]}", response,
                       _refused(response, 422, "PATH_NOT_ALLOWED") and _field(response) == field)
    finally:
        link.unlink()
        secret.unlink()


def isolation(stack: Stack) -> dict[str, Any]:
    log = Attacks()
    with stack.http() as http:
        admin = _bearer(stack.plane.admin_token)
        owner = _token(http, admin, f"tenant-a-{secrets.token_hex(2)}", ["submit"])
        other = _token(http, admin, f"tenant-b-{secrets.token_hex(2)}", ["submit"])
        runs_before = stack.sql("SELECT COUNT(*) FROM runs")[0][0]
        _directories(stack, http, owner, log)
        refused_nothing_stored = stack.sql("SELECT COUNT(*) FROM runs")[0][0] == runs_before
        owned = _ownership(stack, http, owner, other, log)
        _dashboard_ownership(stack, http, owner, other, log)
        _hosts(stack, http, admin, owner, log)
        _attempts(stack, http, owned, owner, log)
        _metrics_from_another_process(stack, http, owner, log)
        _forged_checkpoint_dir(stack, http, owner, log)
        _forged_row_and_backfill(stack, http, owner, log)
    blocked = sum(item["blocked"] for item in log.tried)
    return outcome({
        "every probe was blocked": blocked == len(log.tried),
        "refused specs stored nothing": refused_nothing_stored,
        "at least 15 probes tried": len(log.tried) >= 15,
    }, isolation_tried=len(log.tried), isolation_blocked=blocked, probes=log.tried)
