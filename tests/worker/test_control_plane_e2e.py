"""End to end on the real local PostgreSQL and Redis: the API (with its scheduler) and three Celery host
workers as separate processes, real `locojax host` engine processes with `jax.distributed` across them.

Every run here is submitted over REST and observed only through the REST API and the process table,
as a user or operator would.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from locojax.client import ApiClient
from locojax.launch import free_port
from server.embedded import ControlPlane, start
from tests.conftest import session_processes
from tests.e2e.helpers import alive, host_pids, last_step, steps_of, tiny_spec, wait_final, wait_until
from tests.worker.planes import emptied_redis, plane_settings, stop_leaving_nothing

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]

REDIS_URL = "redis://127.0.0.1:6379/7"  # a database of its own, emptied before the module


@pytest.fixture(scope="module")
def plane(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    settings = plane_settings(tmp_path_factory.mktemp("plane"), postgres_url, emptied_redis(REDIS_URL),
                              reward_modules=["tests.locojax.rewards_for_tests"])
    control_plane = start(settings, hosts=3, port=free_port())
    yield control_plane
    stop_leaving_nothing(control_plane)


@pytest.fixture
def api(plane: ControlPlane) -> Iterator[ApiClient]:
    with plane.client() as client:
        yield client


def test_two_host_co_run_through_celery_succeeds_with_every_metric(api: ApiClient):
    decision = api.request("POST", "/api/v1/placement/recommend",
                           json={"model": "tiny", "hardware": "local-cpu", "chips": 2, "chips_per_host": 1,
                                 "workload": "arith"})
    steps = 5
    spec = tiny_spec("e2e-co", hosts=2, steps=steps, placement={"mode": "co", "hosts": 2, "devices_per_host": 1,
                                                               "decision_id": decision["id"]},
                     debug={"checksum_every": 1})  # the checksum below is reported only when asked
    run = api.submit(spec)
    final = wait_final(api, run["id"])
    assert final["status"] == "SUCCEEDED", final["status_reason"]

    rows = api.list_run_hosts(run["id"])
    assert sorted((r["process_index"], r["status"], r["exit_code"]) for r in rows) == [(0, "EXITED", 0), (1, "EXITED", 0)]
    assert len({r["host_name"] for r in rows}) == 2  # two workers, two hosts
    for host in (-1, 0, 1):
        for key in ("time/step", "reward/mean", "time/host"):
            assert steps_of(api, run["id"], key, host) == list(range(steps)), (key, host)
    # Exactly once, counted where a duplicate cannot hide: the API counts every value it receives (the
    # step_metrics primary key would collapse a second post), and with no fault nothing is posted twice.
    deliveries = api.metric_deliveries(run["id"])["series"]
    assert deliveries and all(s["values_posted"] == s["values_stored"] for s in deliveries), [
        s for s in deliveries if s["values_posted"] != s["values_stored"]]
    assert {s["values_stored"] for s in deliveries if s["key"] == "time/step"} == {steps}
    # One jax.distributed job: both processes hold identical parameters after every step.
    checksums = {host: api.metric_history(run["id"], ["params/checksum"], hosts=[host])["series"][0]["last"]
                 for host in (0, 1)}
    assert checksums[0] == checksums[1]
    assert final["measured_step_s"] and final["measured_step_s"] > 0
    measured = api.request("GET", f"/api/v1/placement/decisions/{decision['id']}")
    assert measured["measured_step_s"] == pytest.approx(final["measured_step_s"])
    assert measured["measured_run_id"] == run["id"]
    # Priced on its hosts' hardware when they were reserved, and its end taught the placement model.
    assert final["hardware"] == "local-cpu" and final["predicted"]["step_s"] > 0
    mine = [o for o in api.list_observations(hardware="local-cpu")["data"] if o["run_id"] == run["id"]]
    assert len(mine) == 1 and mine[0]["measured"]["steps"] == steps - 1 and mine[0]["finished"]
    assert mine[0]["predicted"]["step_s"] == pytest.approx(final["predicted"]["step_s"])


def test_cancel_mid_run_ends_cancelled_quickly_with_no_process_left(api: ApiClient):
    run = api.submit(tiny_spec("e2e-cancel", hosts=2, steps=400, every=2))
    wait_until(lambda: last_step(api, run["id"]) >= 2, 240, "two steps")
    pids = host_pids(api, run["id"])
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    asked = time.monotonic()
    api.cancel_run(run["id"])
    final = wait_final(api, run["id"], timeout_s=30)
    took = time.monotonic() - asked
    assert final["status"] == "CANCELLED" and took < 15, (final["status"], took)
    wait_until(lambda: not any(alive(pid) for pid in pids), 5, "the host processes to be gone")
    assert final["last_checkpoint_step"] is not None and final["last_checkpoint_step"] >= 2


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_engine_processes_get_a_minimal_environment_and_the_operators_reward_allowlist(api: ApiClient):
    # A reward by import path that the operator allowed (Settings.reward_modules, which the workers see
    # as LOCOJAX_REWARD_MODULES) runs on the hosts; the engine processes see no control-plane secret.
    spec = tiny_spec("e2e-env", hosts=2, steps=400)
    spec["task"]["reward"] = ["gsm8k", "tests.locojax.rewards_for_tests:sleep_100ms_per_tiny_step"]
    run = api.submit(spec)
    wait_until(lambda: last_step(api, run["id"]) >= 1, 240, "a step with the allowed custom reward")
    pids = host_pids(api, run["id"])
    assert len(pids) == 2
    for pid in pids:
        env = _environ(pid)
        assert not [name for name in env if name.startswith("LOCOJAX_")], sorted(env)
        assert not [name for name in env if "PASSWORD" in name or "TOKEN" in name or "SECRET" in name], sorted(env)
        assert "PATH" in env and "HOME" in env
        assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # the operator's, passed through
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert command[command.index(b"--reward-modules") + 1] == b"tests.locojax.rewards_for_tests"
    api.cancel_run(run["id"])
    assert wait_final(api, run["id"], timeout_s=60)["status"] == "CANCELLED"


def test_kill_9_of_a_host_process_recovers_from_the_checkpoint(api: ApiClient):
    steps = 10
    run = api.submit(tiny_spec("e2e-kill", hosts=2, steps=steps, every=2, max_restarts=2))
    wait_until(lambda: (api.get_run(run["id"])["last_checkpoint_step"] or 0) >= 2 and last_step(api, run["id"]) >= 3,
               240, "a checkpoint and four steps")
    victim = next(row for row in api.list_run_hosts(run["id"]) if row["process_index"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: api.get_run(run["id"])["restarts"] >= 1, 30, "the run to go RECOVERING")
    final = wait_final(api, run["id"])
    assert final["status"] == "SUCCEEDED", final["status_reason"]
    assert (final["restarts"], final["attempt"]) == (1, 1)
    messages = [event["message"] for event in api.events(run["id"])["data"]]
    assert any("RUNNING -> RECOVERING" in m and "exit code -9" in m for m in messages), messages
    assert any("RECOVERING -> STARTING" in m and "from the checkpoint at step" in m for m in messages), messages
    for host in (-1, 0, 1):
        for key in ("time/step", "reward/mean"):
            assert steps_of(api, run["id"], key, host) == list(range(steps)), (key, host)  # none lost
    # The restarted relay posts the file again from its start: the API counts those reposts (which the
    # upsert collapses), so a step stored once is visibly not a step posted once.
    deliveries = {(s["key"], s["host"]): s for s in api.metric_deliveries(run["id"])["series"]}
    assert all(s["values_posted"] >= s["values_stored"] for s in deliveries.values())
    assert deliveries[("time/step", -1)]["values_posted"] > steps
    assert not any(alive(pid) for pid in host_pids(api, run["id"], 0) + host_pids(api, run["id"], 1))


def test_two_runs_of_two_hosts_on_three_hosts_never_half_reserve(api: ApiClient):
    first = api.submit(tiny_spec("e2e-gang-a", hosts=2, steps=6))
    second = api.submit(tiny_spec("e2e-gang-b", hosts=2, steps=2))
    seen_first_running = False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        a, b = api.get_run(first["id"]), api.get_run(second["id"])
        held_by_b = sum(1 for host in api.request("GET", "/api/v1/hosts")["data"]
                        if host["reserved_by_run_id"] == second["id"])
        assert held_by_b in (0, 2), f"run {second['id']} holds {held_by_b} of its 2 hosts"
        if a["status"] in ("STARTING", "RUNNING"):
            seen_first_running = True
            assert b["status"] == "QUEUED"
        if a["status"] == "SUCCEEDED":
            break
        time.sleep(0.2)
    assert seen_first_running
    assert wait_final(api, second["id"])["status"] == "SUCCEEDED"


def _cores_of(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


@pytest.mark.parametrize("hosts", [2, 3])
def test_an_sc_run_uses_every_reserved_host_a_worker_each_beside_one_controller(api: ApiClient, hosts: int):
    """SC as a real single controller: process 0 (the controller, whose child is the first host's worker)
    and a worker on every other reserved host, each within its host worker's cores; every host's
    worker reports its own figures, host 0 also the controller's record."""
    steps = 3
    spec = tiny_spec(f"e2e-sc{hosts}", hosts=hosts, steps=steps, placement={"mode": "sc", "hosts": hosts,
                                                                          "devices_per_host": 1},
                     debug={"checksum_every": 1})
    spec["rollout"]["prompts_per_step"] = 2 * hosts  # whole groups on every host
    run = api.submit(spec)
    cores = {h["name"]: set(h["info"]["cores"]) for h in api.request("GET", "/api/v1/hosts")["data"]}

    def running_rows() -> list[dict] | None:
        rows = api.list_run_hosts(run["id"])
        return rows if len(rows) == hosts and all(r["pid"] and r["status"] == "RUNNING" for r in rows) else None

    rows = wait_until(running_rows, 240, "every SC process to run")
    pinned = {r["process_index"]: (_cores_of(r["pid"]), cores[r["host_name"]]) for r in rows if alive(r["pid"])}
    assert pinned and all(mine <= allowed for mine, allowed in pinned.values()), pinned
    final = wait_final(api, run["id"])
    assert final["status"] == "SUCCEEDED", final["status_reason"]
    rows = api.list_run_hosts(run["id"])
    assert [(r["process_index"], r["role"], r["status"]) for r in rows] == (
        [(0, "controller", "EXITED")] + [(i, "worker", "EXITED") for i in range(1, hosts)])
    assert len({r["host_name"] for r in rows}) == hosts  # a process on every reserved host
    assert steps_of(api, run["id"], "reward/mean", 0) == list(range(steps))
    for host in range(hosts):
        assert steps_of(api, run["id"], "sc/worker_sample", host) == list(range(steps)), host
    # The workers are one jax.distributed job: identical weights on every host after the last step.
    checksums = {tuple(api.metric_history(run["id"], ["params/checksum"], hosts=[w])["series"][0]["last"])
                 for w in range(hosts)}
    assert len(checksums) == 1
    assert wait_until(lambda: not session_processes("locojax.cli sc-worker"), 10, "the SC workers to exit") is True
