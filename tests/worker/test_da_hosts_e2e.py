"""DA across the hosts it reserved, end to end through REST: a control plane with three workers (each a
host pinned to its own cores), real engine processes, one Ray cluster per attempt spanning the run's
reserved hosts (locojax.modes.da_cluster).

What a DA run of H hosts must show: a process on every reserved worker in the run's host table (the
driver, then one Ray node per other host, in its group), every engine and every actor process within
its worker's cores and on the host its layout gave it, Ray on the workers' addresses and holding the
attempt's secret as a file (never in an environment or command line), per-host metrics, and no Ray
process anywhere once the run ended (success, failure, cancel). The last test gives each worker a
network namespace of its own, so the run's traffic crosses real interfaces.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from locojax.client import ApiClient
from locojax.launch import cores_for_host, free_port
from server.embedded import ControlPlane, start
from server.embedded import _spawn as spawn
from tests.conftest import create_postgres_database, session_processes
from tests.e2e.faults import messages as every_message
from tests.e2e.helpers import alive, host_pids, last_step, steps_of, tiny_spec, wait_final, wait_until
from tests.e2e import netns
from tests.worker.planes import emptied_redis, plane_settings, stop_leaving_nothing

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]

REDIS_URL = "redis://127.0.0.1:6379/11"  # a database of its own (tests/worker/test_control_plane_e2e.py has 7)


@pytest.fixture(scope="module")
def plane(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    settings = plane_settings(tmp_path_factory.mktemp("plane"), postgres_url, emptied_redis(REDIS_URL))
    control_plane = start(settings, hosts=3, port=free_port())
    yield control_plane
    stop_leaving_nothing(control_plane)


@pytest.fixture
def api(plane: ControlPlane) -> Iterator[ApiClient]:
    with plane.client() as client:
        yield client

# Every process of Ray: its programs and scripts (GCS, raylet, monitors) and its workers and agents.
RAY_PROCESSES = ("site-packages/ray/", "ray::")


def _ray_processes() -> list[int]:
    return sorted({pid for name in RAY_PROCESSES for pid in session_processes(name)})


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def _cores(pid: int) -> list[int]:
    return sorted(os.sched_getaffinity(pid))


def _engine_of(pid: int, engines: dict[int, int]) -> int | None:
    """The reserved host (process index) whose engine process `pid` descends from."""
    while pid > 1:
        if pid in engines:
            return engines[pid]
        pid = _parent(pid)
    return None


def _still_there(check, pids: list[int]) -> None:
    """`check(pid)` for each of `pids` still alive (an idle Ray worker may exit while we look)."""
    for pid in pids:
        try:
            check(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue


def _param_bytes(spec: dict) -> int:
    """Bytes of the spec's starting parameters: what one weight push sends."""
    import jax
    import numpy as np

    from locojax.policy import load_policy
    from locojax.spec import RunSpec

    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(load_policy(RunSpec.model_validate(spec)).params))


def _actors() -> dict[str, list[int]]:
    return {group: session_processes(f"ray::{group}") for group in ("RolloutHost", "TrainHost")}


@pytest.mark.parametrize("hosts, rollout_fraction, groups", [
    (2, 0.5, ["train", "rollout"]),
    (3, 0.34, ["train", "train", "rollout"]),  # two train hosts: one JAX job across two machines' actors
])
def test_a_da_run_uses_every_host_it_reserved_through_one_ray_cluster(plane, api: ApiClient, hosts,
                                                                      rollout_fraction, groups):
    steps = 4
    spec = tiny_spec(f"e2e-da-{hosts}", hosts=hosts, steps=steps, debug={"checksum_every": 1})
    spec["placement"] = {"mode": "da", "hosts": hosts, "devices_per_host": 1, "rollout_fraction": rollout_fraction}
    run = api.submit(spec)
    workers = {h["name"]: h["info"] for h in api.request("GET", "/api/v1/hosts")["data"]}

    directory = Path(plane.settings.runs_root) / f"{run['id']}-{spec['name']}"
    secret_file = directory / ".control" / "secret-attempt0-host0"

    # The attempt's secret is read as soon as its worker writes it, before the engine starts: the worker
    # removes the file when the attempt ends, and on a fast machine a four-step run ends within a second
    # of its actors coming up.
    def the_secret() -> bytes | None:
        try:
            return secret_file.read_bytes()
        except FileNotFoundError:
            return None

    secret = wait_until(the_secret, 240, "the attempt's secret file")

    # While it runs: every reserved host has its engine process and its actor, on that worker's cores.
    def running():
        rows = api.list_run_hosts(run["id"])
        actors = _actors()
        placed = len(rows) == hosts and all(r["pid"] for r in rows)
        alive = placed and len(actors["TrainHost"]) + len(actors["RolloutHost"]) == hosts
        return alive and (rows, actors)

    rows, actors = wait_until(running, 240, "every reserved host's process and actor")
    rows.sort(key=lambda r: r["process_index"])
    assert [r["role"] for r in rows] == ["controller"] + groups[1:]
    assert len({r["host_name"] for r in rows}) == hosts  # one process on each reserved worker
    engines = {r["pid"]: r["process_index"] for r in rows}
    cores_of = {r["process_index"]: sorted(workers[r["host_name"]]["cores"]) for r in rows}
    for row in rows:
        assert _cores(row["pid"]) == cores_of[row["process_index"]], row
    where = {group: sorted(_engine_of(pid, engines) for pid in pids) for group, pids in actors.items()}
    assert where == {"TrainHost": [h for h, g in enumerate(groups) if g == "train"],
                     "RolloutHost": [h for h, g in enumerate(groups) if g == "rollout"]}
    ray_pids = _ray_processes()

    def on_its_hosts_cores(pid: int) -> None:  # raylets, GCS, agents, actors: each within its host's cores
        host = _engine_of(pid, engines)
        assert host is not None and _cores(pid) == cores_of[host], (pid, host)

    _still_there(on_its_hosts_cores, ray_pids)
    # These workers' address is 127.0.0.1, and on a loopback node address Ray 2.60 listens on loopback
    # only: nothing of the run is reachable from off the machine (on a routable address the bind shim
    # keeps it to that address, test_a_da_run_on_hosts_with_networks_of_their_own...). Its token is the attempt's
    # secret, read from the file its worker wrote, so it is in no process's environment or command line.
    def binds_its_workers_address(pid: int) -> None:
        addresses = {address for address, _ in netns.listening(pid)}
        assert addresses <= {"127.0.0.1"}, (pid, addresses)

    _still_there(binds_its_workers_address, ray_pids)
    assert len(secret) >= 32

    def secret_not_shown(pid: int) -> None:
        for view in ("environ", "cmdline"):
            assert secret not in Path(f"/proc/{pid}/{view}").read_bytes(), (pid, view)

    _still_there(secret_not_shown, ray_pids + list(engines))

    final = wait_final(api, run["id"])
    assert final["status"] == "SUCCEEDED", final["status_reason"]
    ended = sorted((r["process_index"], r["status"], r["exit_code"]) for r in api.list_run_hosts(run["id"]))
    assert ended == [(i, "EXITED", 0) for i in range(hosts)]
    # Per-host metrics: each train host's train step, each rollout host's rollout, the driver's step.
    for host, group in enumerate(groups):
        key = "time/train" if group == "train" else "reward/mean"
        assert steps_of(api, run["id"], key, host) == list(range(steps)), (key, host)
    assert steps_of(api, run["id"], "time/step", 0) == list(range(steps))
    staleness = api.metric_history(run["id"], ["da/staleness"], hosts=[-1])["series"][0]
    assert (staleness["steps"], staleness["last"]) == (list(range(steps)), [0.0] + [1.0] * (steps - 1))
    assert wait_until(lambda: not _ray_processes(), 30, "every Ray process on every host to be gone") is True
    assert not (Path.home() / ".ray").exists() or not any((Path.home() / ".ray").iterdir())


def _da_spec(name: str, steps: int, **extra) -> dict:
    spec = tiny_spec(name, hosts=2, steps=steps, every=2, **extra)
    spec["placement"] = {"mode": "da", "hosts": 2, "devices_per_host": 1, "rollout_fraction": 0.5}
    return spec


@pytest.mark.parametrize("victim", ["actor", "node"])
def test_a_da_run_whose_rollout_host_dies_fails_naming_it_and_leaves_no_ray_anywhere(api: ApiClient, victim):
    run = api.submit(_da_spec(f"e2e-da-lost-{victim}", 400, max_restarts=0))
    wait_until(lambda: last_step(api, run["id"]) >= 1, 240, "two steps")
    node = next(row for row in api.list_run_hosts(run["id"]) if row["role"] == "rollout")
    if victim == "actor":  # the rollout actor's process on that host: its node lives on, the driver sees it go
        [pid] = [pid for pid in session_processes("ray::RolloutHost")]
    else:  # the host's Ray node process, and with it its raylet and actor
        pid = node["pid"]
    os.kill(pid, signal.SIGKILL)
    final = wait_final(api, run["id"], timeout_s=120)
    assert final["status"] == "FAILED", final["status_reason"]
    if victim == "actor":
        # The driver's failure names the actor's host and what it was doing; it ends the run.
        assert final["status_reason"].startswith(f"host process 0 on {node['host_name'][:-1]}0 failed"), final
        lines = every_message(api, run["id"])
        assert any("rollout host 0" in line and " during " in line for line in lines), lines[-5:]
    else:
        # The lost host's own process ends the run first, named with its host.
        assert final["status_reason"].startswith(f"host process 1 on {node['host_name']} failed"), final
    assert wait_until(lambda: not _ray_processes(), 30, "every Ray process on every host to be gone") is True
    # The other host's node process ends once it sees the head gone (or its worker stops it).
    wait_until(lambda: not any(alive(pid) for pid in host_pids(api, run["id"])), 30, "every host process to end")


def test_a_da_run_whose_ray_node_is_killed_recovers_on_a_new_cluster_from_its_checkpoint(api: ApiClient):
    steps = 6
    run = api.submit(_da_spec("e2e-da-recover", steps, max_restarts=1))
    wait_until(lambda: (api.get_run(run["id"])["last_checkpoint_step"] or 0) >= 2, 240, "a checkpoint")
    node = next(row for row in api.list_run_hosts(run["id"]) if row["role"] == "rollout")
    os.kill(node["pid"], signal.SIGKILL)
    final = wait_final(api, run["id"])
    assert final["status"] == "SUCCEEDED", final["status_reason"]
    assert (final["restarts"], final["attempt"]) == (1, 1)
    again = sorted((r["process_index"], r["role"], r["status"]) for r in api.list_run_hosts(run["id"], 1))
    assert again == [(0, "controller", "EXITED"), (1, "rollout", "EXITED")]
    assert steps_of(api, run["id"], "da/staleness", -1) == list(range(steps))  # none lost
    assert wait_until(lambda: not _ray_processes(), 30, "every Ray process on every host to be gone") is True


def test_a_cancelled_da_run_stops_every_host_and_leaves_no_ray_anywhere(api: ApiClient):
    run = api.submit(_da_spec("e2e-da-cancel", 400))
    wait_until(lambda: last_step(api, run["id"]) >= 1, 240, "two steps")
    api.cancel_run(run["id"])
    final = wait_final(api, run["id"], timeout_s=60)
    assert final["status"] == "CANCELLED", final["status_reason"]
    ended = sorted((r["process_index"], r["status"]) for r in api.list_run_hosts(run["id"]))
    assert ended == [(0, "EXITED"), (1, "EXITED")]  # the driver at a step boundary, the node when its head went
    assert wait_until(lambda: not _ray_processes(), 30, "every Ray process on every host to be gone") is True
    assert final["last_checkpoint_step"] is not None and final["last_checkpoint_step"] >= 1


# --- hosts on networks of their own ---------------------------------------------------------------------

NETNS_REDIS_DB = 12


@pytest.fixture(scope="module")
def netns_database(request: pytest.FixtureRequest) -> Iterator[str]:
    """The namespaced plane's own database: the module's first plane is still up beside it, and two
    planes on one database would schedule each other's runs on hosts of the same names."""
    url, drop = create_postgres_database(request.config.getoption("--postgres-url"), prefix="locojax_netns")
    yield url
    drop()


@pytest.fixture(scope="module")
def netns_plane(netns_database: str, tmp_path_factory: pytest.TempPathFactory):
    """The API in the machine's namespace; three workers, each in a network namespace of its own with its
    own address on a bridge (tests/e2e/netns.py), reaching the API and broker through it."""
    reason = netns.available()
    if reason is not None:
        pytest.skip(reason)
    settings = plane_settings(tmp_path_factory.mktemp("netns-plane"), netns_database,
                              emptied_redis(f"redis://127.0.0.1:6379/{NETNS_REDIS_DB}"))
    port = free_port()
    with netns.NamespacedHosts(3) as hosts:
        control_plane = start(settings, hosts=0, port=port)  # the API only; the workers start below
        bridge = hosts.machine_address
        forwards = [netns.Forwarder((bridge, port), ("127.0.0.1", port)),
                    netns.Forwarder((bridge, 6379), ("127.0.0.1", 6379))]
        try:
            env = settings.as_environment(LOCOJAX_URL=f"http://{bridge}:{port}", PYTHONUNBUFFERED="1",
                                          LOCOJAX_BROKER_URL=f"redis://{bridge}:6379/{NETNS_REDIS_DB}",
                                          LOCOJAX_TOKEN=control_plane.worker_token)
            for index in range(hosts.count):
                name = f"local{index}"
                cores = ",".join(map(str, cores_for_host(index, hosts.count)))
                command = [sys.executable, "-m", "locojax.cli", "worker", "--name", name, "--cores", cores,
                           "--devices", "1", "--address", hosts.address(index)]
                control_plane.processes[name] = spawn(hosts.command(index, command), env,
                                                      Path(settings.home) / "logs" / f"worker-{name}.log")
                control_plane.host_names.append(name)
            with control_plane.client() as client:
                wait_until(lambda: {h["name"] for h in client.request("GET", "/api/v1/hosts")["data"]
                                    if h["status"] == "ONLINE"} >= set(control_plane.host_names), 120,
                           "the workers in their namespaces to register")
            yield control_plane, hosts
        finally:
            control_plane.stop()
            for forward in forwards:
                forward.close()
    assert [name for name, process in control_plane.processes.items() if process.poll() is None] == []


def test_a_da_run_on_hosts_with_networks_of_their_own_talks_over_their_interfaces(netns_plane):
    control_plane, hosts = netns_plane
    steps, groups = 3, ["train", "train", "rollout"]
    spec = tiny_spec("e2e-da-netns", hosts=3, steps=steps)
    spec["placement"] = {"mode": "da", "hosts": 3, "devices_per_host": 1, "rollout_fraction": 0.34}
    before = [hosts.interface_bytes(host) for host in range(hosts.count)]
    with control_plane.client() as api:
        run = api.submit(spec)

        def running():
            rows = api.list_run_hosts(run["id"])
            actors = _actors()
            return (len(rows) == 3 and all(r["pid"] for r in rows)
                    and len(actors["TrainHost"]) + len(actors["RolloutHost"]) == 3 and (rows, actors))

        rows, actors = wait_until(running, 240, "every reserved host's process and actor")
        rows.sort(key=lambda r: r["process_index"])
        assert [r["host_name"] for r in rows] == ["local0", "local1", "local2"]
        # The Ray head is where host 0's worker is: its own address, published for the other hosts.
        assert rows[0]["address"].rsplit(":", 1)[0] == hosts.address(0)
        engines = {r["pid"]: r["process_index"] for r in rows}
        where = {group: sorted(_engine_of(pid, engines) for pid in pids) for group, pids in actors.items()}
        assert where == {"TrainHost": [0, 1], "RolloutHost": [2]}

        def in_its_hosts_network(pid: int) -> None:  # every Ray process in its own host's namespace,
            host = _engine_of(pid, engines)  # listening on that host's address only (locojax.bind_address)
            assert os.readlink(f"/proc/{pid}/ns/net") == hosts.namespace_id(host), (pid, host)
            addresses = {address for address, _ in netns.listening(pid)}
            assert addresses <= {hosts.address(host)}, (pid, host, addresses)

        _still_there(in_its_hosts_network, _ray_processes())
        final = wait_final(api, run["id"])
        assert final["status"] == "SUCCEEDED", final["status_reason"]
        for host, group in enumerate(groups):
            key = "time/train" if group == "train" else "reward/mean"
            assert steps_of(api, run["id"], key, host) == list(range(steps)), (key, host)
    moved = [hosts.interface_bytes(host) - before[host] for host in range(hosts.count)]
    # Each host's own interface carried the run: the rollout host received the weights after each train
    # step but the last, the driver's host sent them, and the two train hosts all-reduced their
    # gradients every step over theirs.
    weights = _param_bytes(spec)
    assert moved[2] >= (steps - 1) * weights and min(moved[:2]) >= (steps - 1) * weights, (moved, weights)
    assert wait_until(lambda: not _ray_processes(), 30, "every Ray process on every host to be gone") is True
