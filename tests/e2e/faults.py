"""Fault scenarios: break one part of a live control plane while runs train, then check that every run
still SUCCEEDED with every step's metrics stored (none lost, none stale; values posted more than once
are counted by the API and reported as `values_reposted`), nothing queued was lost, and no engine process
was left behind.

  kill_host_process   SIGKILL one engine process of a two-host run
  kill_worker         SIGKILL the Celery worker of one host of a two-host run (its engine dies with it);
                      the worker is started again at once under the same name, as compose would
  restart_redis       SIGKILL the broker (no persistence: queued messages die with it) while a run trains,
                      submit and queue runs while it is down, start it again
  stop_postgres       stop the database for 10 s while a run trains: /readyz says 503, the workers buffer
                      metrics and deliver them after
  kill_api            SIGKILL the API process (the scheduler lives in it) with a run training and one
                      queued, start it again on the same port

Each returns `outcome(...)` (see tests/e2e/outcome.py); `recover` in its details says what recover_s measures.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx

from locojax.client import ApiClient, ApiClientError
from tests.e2e.helpers import last_step, tiny_spec, wait_final, wait_until
from tests.e2e.infra import Stack, wait_gone
from tests.e2e.outcome import audit_run, failed, last_written_step, outcome, output_dir

RUN_TIMEOUT_S = 400.0  # generous: two shared cores, JAX start-up and compilation per attempt


def quietly(fn: Any, *args: Any, default: Any = None, **kwargs: Any) -> Any:
    """Call the API; `default` while it is unreachable or answers 5xx (a dependency is down)."""
    try:
        return fn(*args, **kwargs)
    except httpx.TransportError:
        return default
    except ApiClientError as exc:
        if exc.status >= 500:
            return default
        raise


def _run(api: ApiClient, run_id: int) -> dict[str, Any]:
    return quietly(api.get_run, run_id, default={"status": "?", "attempt": -1, "restarts": 0,
                                                 "last_checkpoint_step": None})


def _progress(api: ApiClient, run_id: int) -> int:
    return quietly(last_step, api, run_id, default=-1)


def wait_training(api: ApiClient, run_id: int, *, step: int, checkpoint: int | None = None) -> None:
    """Until the API shows `step` (and a checkpoint at or after `checkpoint`)."""
    def ready() -> bool:
        run = _run(api, run_id)
        if run["status"] in ("FAILED", "CANCELLED"):
            raise AssertionError(f"run {run_id} ended {run['status']} before the fault: {run.get('status_reason')}")
        checkpointed = checkpoint is None or (run["last_checkpoint_step"] or -1) >= checkpoint
        return checkpointed and _progress(api, run_id) >= step

    wait_until(ready, RUN_TIMEOUT_S, f"run {run_id} to reach step {step}")


def wait_new_attempt(api: ApiClient, run_id: int, after_attempt: int) -> float:
    """Until the run RUNNING again in a later attempt; returns when (time.monotonic())."""
    wait_until(lambda: (run := _run(api, run_id))["attempt"] > after_attempt
               and run["status"] in ("RUNNING", "SUCCEEDED"), RUN_TIMEOUT_S, f"run {run_id} to run again")
    return time.monotonic()


def messages(api: ApiClient, run_id: int) -> list[str]:
    found, after = [], 0
    while True:
        page = api.events(run_id, after=after)["data"]
        if not page:
            return found
        found += [event["message"] for event in page]
        after = page[-1]["id"]


def _transitions(api: ApiClient, run_id: int) -> list[str]:
    return [message[:160] for message in messages(api, run_id) if " -> " in message]


# --- the scenarios ------------------------------------------------------------------------------------

def kill_host_process(stack: Stack) -> dict[str, Any]:
    with stack.client() as api:
        run = api.submit(tiny_spec("rel-kill-host", hosts=2, steps=24, every=4, max_restarts=2))
        try:
            wait_training(api, run["id"], step=5, checkpoint=4)
            victim = next(row for row in api.list_run_hosts(run["id"]) if row["process_index"] == 1)
            os.kill(victim["pid"], signal.SIGKILL)
            killed = time.monotonic()
            recover_s = wait_new_attempt(api, run["id"], after_attempt=0) - killed
            final = wait_final(api, run["id"], RUN_TIMEOUT_S)
        except AssertionError as exc:
            return failed(exc, run_id=run["id"])
        found = messages(api, run["id"])
        return outcome({
            "run SUCCEEDED": final["status"] == "SUCCEEDED",
            "one restart": (final["restarts"], final["attempt"]) == (1, 1),
            "the kill was reported as exit code -9": any("RUNNING -> RECOVERING" in m and "exit code -9" in m
                                                         for m in found),
            "restarted from the checkpoint": any("RECOVERING -> STARTING" in m and "from the checkpoint at step" in m
                                                 for m in found),
        }, recover_s=recover_s, audits=[audit_run(stack, api, run["id"], hosts=2)],
            recover="seconds from the SIGKILL until the run is RUNNING again in a new attempt",
            victim={"host": victim["host_name"], "pid": victim["pid"]}, transitions=_transitions(api, run["id"]))


def kill_worker(stack: Stack, restart_after_s: float = 1.0) -> dict[str, Any]:
    with stack.client() as api:
        run = api.submit(tiny_spec("rel-kill-worker", hosts=2, steps=24, every=4, max_restarts=2))
        try:
            wait_training(api, run["id"], step=5, checkpoint=4)
            victim = next(row for row in api.list_run_hosts(run["id"]) if row["process_index"] == 1)
            stack.kill(victim["host_name"])
            killed = time.monotonic()
            engine_gone = not wait_gone([victim["pid"]], 10.0)
            time.sleep(restart_after_s)
            stack.start_worker(victim["host_name"])
            recover_s = wait_new_attempt(api, run["id"], after_attempt=0) - killed
            final = wait_final(api, run["id"], RUN_TIMEOUT_S)
            stack.wait_healthy()
        except AssertionError as exc:
            return failed(exc, run_id=run["id"])
        return outcome({
            "run SUCCEEDED": final["status"] == "SUCCEEDED",
            "restarted": final["restarts"] >= 1,
            "the engine process died with its worker": engine_gone,
            "the restarted worker is ONLINE": victim["host_name"] in stack.hosts_online(),
        }, recover_s=recover_s, audits=[audit_run(stack, api, run["id"], hosts=2)],
            recover="seconds from the worker's SIGKILL until the run is RUNNING again in a new attempt",
            victim={"worker": victim["host_name"], "engine_pid": victim["pid"]},
            worker_restarted_after_s=restart_after_s, transitions=_transitions(api, run["id"]))


def restart_redis(stack: Stack, down_s: float = 4.0) -> dict[str, Any]:
    with stack.client() as api:
        # At least 100 ms a step: still training when the broker comes back, however fast the machine.
        training = api.submit(tiny_spec("rel-redis-a", hosts=1, steps=200, every=50,
                                        task={"name": "arith", "difficulty": 1, "reward": [
                                            "gsm8k", "tests.locojax.rewards_for_tests:sleep_100ms_per_tiny_step"]}))
        try:
            wait_training(api, training["id"], step=3)
            stack.redis.kill()
            killed = time.monotonic()
            # While the broker is down: one run that can start at once (its start message cannot be sent)
            # and one that has to queue for two hosts (one is free).
            dispatched = api.submit(tiny_spec("rel-redis-b", hosts=1, steps=3))
            queued = api.submit(tiny_spec("rel-redis-c", hosts=2, steps=2))
            readiness = wait_until(lambda: (code := stack.ready()) == 503 and code, 30, "/readyz to say 503")
            time.sleep(max(0.0, down_s - (time.monotonic() - killed)))
            waiting = {"training": _run(api, training["id"])["status"],
                       "submitted during the outage": _run(api, dispatched["id"])["status"],
                       "queued": _run(api, queued["id"])["status"]}
            stack.redis.start()
            restarted = time.monotonic()
            wait_until(lambda: _run(api, dispatched["id"])["status"] in ("RUNNING", "SUCCEEDED"), RUN_TIMEOUT_S,
                       "the run submitted during the outage to start")
            recover_s = time.monotonic() - restarted
            finals = [wait_final(api, run["id"], RUN_TIMEOUT_S) for run in (training, dispatched, queued)]
            stack.wait_healthy()
        except AssertionError as exc:
            return failed(exc, run_id=training["id"])
        return outcome({
            "/readyz answered 503 while the broker was down": readiness == 503,
            "at the restart, one run trained, one waited for its start message and one in the queue":
                waiting == {"training": "RUNNING", "submitted during the outage": "STARTING", "queued": "QUEUED"},
            "every run SUCCEEDED (none of the queued lost)": all(run["status"] == "SUCCEEDED" for run in finals),
            "the training run did not restart": finals[0]["restarts"] == 0,
        }, recover_s=recover_s, audits=[audit_run(stack, api, training["id"], hosts=1),
                                        audit_run(stack, api, dispatched["id"], hosts=1),
                                        audit_run(stack, api, queued["id"], hosts=2)],
            recover="seconds from Redis answering again until the run submitted during the outage is RUNNING",
            broker_down_s=round(restarted - killed, 2), at_restart=waiting,
            dispatched_events=[m[:160] for m in messages(api, dispatched["id"])
                               if " -> " in m or "sent again" in m])


def stop_postgres(stack: Stack, down_s: float = 10.0) -> dict[str, Any]:
    with stack.client() as api:
        run = api.submit(tiny_spec("rel-postgres", hosts=1, steps=300, every=50))
        try:
            wait_training(api, run["id"], step=3)
            before = _progress(api, run["id"])
            stack.postgres.stop("fast")
            stopped = time.monotonic()
            readiness = []
            while time.monotonic() - stopped < down_s:
                readiness.append(stack.ready())
                time.sleep(1.0)
            written_during = last_written_step(stack, run)
            engine_done = not stack.engine_processes(str(output_dir(stack, run)))
            stack.postgres.start()
            started = time.monotonic()
            # Recovered: ready again and every step the engine wrote while the database was down delivered.
            wait_until(lambda: stack.ready() == 200 and _progress(api, run["id"]) >= written_during, 120,
                       "the buffered metrics to arrive")
            recover_s = time.monotonic() - started
            final = wait_final(api, run["id"], RUN_TIMEOUT_S)
            stack.wait_healthy()
        except AssertionError as exc:
            return failed(exc, run_id=run["id"])
        return outcome({
            "/readyz answered 503 all through the outage": bool(readiness) and all(code == 503 for code in readiness),
            "the engine trained on while the database was down": written_during > before,
            "run SUCCEEDED": final["status"] == "SUCCEEDED",
            "no restart": final["restarts"] == 0,
        }, recover_s=recover_s, audits=[audit_run(stack, api, run["id"], hosts=1)],
            recover="seconds from PostgreSQL accepting connections again until /readyz is 200 and every step "
                    "written during the outage is in the database",
            database_down_s=round(started - stopped, 2), readyz_during_outage=readiness,
            engine_finished_during_outage=engine_done,
            step_before_outage=before, steps_buffered=written_during - before,
            transitions=_transitions(api, run["id"]))


def kill_api(stack: Stack, down_s: float = 12.0) -> dict[str, Any]:
    with stack.client() as api:
        run = api.submit(tiny_spec("rel-api", hosts=1, steps=120, every=20))
        try:
            wait_training(api, run["id"], step=3)
            # Queued behind it: needs all three hosts.
            queued = api.submit(tiny_spec("rel-api-queued", hosts=3, steps=2, rollout={
                "prompts_per_step": 6, "group_size": 2, "max_prompt_tokens": 48, "max_new_tokens": 6}))
            before = _progress(api, run["id"])
            queued_at_kill = _run(api, queued["id"])["status"]
            stack.kill("api")
            killed = time.monotonic()
            time.sleep(down_s)
            written_during = last_written_step(stack, run)
            stack.start_api()
            started = time.monotonic()
            wait_until(lambda: _progress(api, run["id"]) >= written_during, 120, "the buffered metrics to arrive")
            recover_s = time.monotonic() - started
            finals = [wait_final(api, item["id"], RUN_TIMEOUT_S) for item in (run, queued)]
            stack.wait_healthy()
        except AssertionError as exc:
            return failed(exc, run_id=run["id"])
        return outcome({
            "a run was queued when the API died": queued_at_kill == "QUEUED",
            "every run SUCCEEDED (the queued one too)": all(item["status"] == "SUCCEEDED" for item in finals),
            "the engine trained on while the API was down": written_during > before,
            "no restart": finals[0]["restarts"] == 0,
        }, recover_s=recover_s, audits=[audit_run(stack, api, run["id"], hosts=1),
                                        audit_run(stack, api, queued["id"], hosts=3)],
            recover="seconds from the new API process being ready until every step written while it was down "
                    "is in the database",
            api_down_s=round(started - killed, 2), steps_buffered=written_during - before,
            transitions=_transitions(api, run["id"]))


FAULTS = {
    "kill_host_process": kill_host_process,
    "kill_worker": kill_worker,
    "restart_redis": restart_redis,
    "stop_postgres": stop_postgres,
    "kill_api": kill_api,
}
