"""The Ray cluster of a DA run across its reserved hosts (locojax.modes.da_cluster): its token is the
attempt's secret, so a client without it (or with another) is refused, and the layout that gives
every reserved host its process and group."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from locojax.modes import MODES
from locojax.spec import PlacementSpec
from tests.conftest import session_processes
from tests.locojax.test_co import ROOT

# The run's head, started as the driver starts it, kept until its stdin closes, then stopped as the
# driver stops it.
HEAD = textwrap.dedent("""
    import sys
    from locojax.launch import free_port
    from locojax.modes import da_cluster
    from locojax.spec import RunSpec

    spec = RunSpec.model_validate({"placement": {"mode": "da", "hosts": 2, "rollout_fraction": 0.5}})
    da_cluster.use_secret_as_token(sys.argv[1])
    listen = f"127.0.0.1:{free_port()}"
    da_cluster.connect_as_driver(listen)
    head = da_cluster.start_head(spec, listen)
    print(listen, flush=True)
    sys.stdin.read()
    head.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    da_cluster.stop_ray_leftovers()
""")

# A client of that cluster under whatever token its environment gives; exit 0 once it ran a task there.
CLIENT = textwrap.dedent("""
    import sys
    from locojax.modes import da_cluster

    da_cluster.connect_as_driver(sys.argv[1])
    import ray

    ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
    print(ray.get(ray.remote(num_cpus=0, resources={"locojax_host_0": 0.01})(lambda: "ran").remote()))
""")


def _start_client(address: str, stderr: Path, **settings: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | settings
    env["PYTHONPATH"] = str(ROOT)
    with stderr.open("w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-c", CLIENT, address], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=log, text=True)


# What Ray's GCS answers a client whose token is missing or not the cluster's.
REFUSAL = "InvalidAuthToken"


def _finish(client: subprocess.Popen, stderr: Path, refused: bool) -> subprocess.CompletedProcess:
    """The client's outcome: an admitted one runs to its end; a refused one is stopped as soon as the
    cluster's refusal is in its log (or when it exits first). After that answer Ray keeps the client
    retrying for a while, ~20 s on a quiet machine and once more than 180 s under load, which tells
    nothing more about the cluster."""
    deadline = time.monotonic() + 180
    while refused and client.poll() is None and time.monotonic() < deadline:
        if REFUSAL in stderr.read_text(errors="replace"):
            client.kill()
            break
        time.sleep(0.2)
    stdout, _ = client.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return subprocess.CompletedProcess(client.args, client.returncode, stdout, stderr.read_text(errors="replace"))


@pytest.mark.multiprocess
def test_the_runs_ray_cluster_admits_only_holders_of_the_attempts_secret(tmp_path: Path):
    secret, other = tmp_path / "secret", tmp_path / "other"
    for path in (secret, other):
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    head = subprocess.Popen([sys.executable, "-c", HEAD, str(secret)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        address = head.stdout.readline().strip()
        assert address, "the head did not start"
        # The three clients side by side; each refused one is done once the cluster has said no.
        logs = [tmp_path / f"client{index}.err" for index in range(3)]
        clients = [_start_client(address, logs[0]),
                   _start_client(address, logs[1], RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(other)),
                   _start_client(address, logs[2], RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(secret))]
        try:
            refused, wrong, admitted = [_finish(client, log, refused=index < 2)
                                        for index, (client, log) in enumerate(zip(clients, logs))]
        finally:
            for client in clients:  # one that timed out, and those not waited for after it
                if client.poll() is None:
                    client.kill()
                    client.wait()
        assert "ran" not in refused.stdout and REFUSAL in refused.stderr, refused.stderr[-2000:]
        assert "ran" not in wrong.stdout and REFUSAL in wrong.stderr, wrong.stderr[-2000:]
        assert admitted.returncode == 0 and admitted.stdout.strip().endswith("ran"), admitted.stderr[-2000:]
        assert REFUSAL not in admitted.stderr
    finally:
        head.communicate(timeout=60)
    assert head.returncode == 0
    assert not session_processes("site-packages/ray/") and not session_processes("ray::")
    assert not (Path.home() / ".ray" / "auth_token").exists()


def test_a_da_run_has_its_driver_on_the_first_host_and_a_ray_node_on_every_other():
    da = MODES.get("da")
    for hosts, fraction, roles in ((2, 0.5, ("controller", "rollout")),
                                   (3, 0.34, ("controller", "train", "rollout")),
                                   (4, 0.75, ("controller", "rollout", "rollout", "rollout"))):
        layout = da.layout(PlacementSpec(mode="da", hosts=hosts, rollout_fraction=fraction))
        assert (layout.hosts, layout.roles, layout.host_of) == (hosts, roles, tuple(range(hosts)))


def test_a_head_that_misses_rays_start_up_wait_is_started_again_on_the_same_port(monkeypatch):
    """A loaded machine can miss Ray's fixed start-up wait for the head's GCS and raylet (it happened to
    a test's head under the full suite): the half-started processes are stopped and the head is started
    again, on the run's port, as a node's start is; a head that never starts raises Ray's error."""
    import ray._private.node

    from locojax.modes import da_cluster
    from locojax.spec import RunSpec

    spec = RunSpec.model_validate({"placement": {"mode": "da", "hosts": 2, "rollout_fraction": 0.5}})
    started, stopped = [], []

    class NodeMissingItsFirstStart:
        def __init__(self, params, head, shutdown_at_exit, spawn_reaper):
            started.append((params.gcs_server_port, head))
            if len(started) < failures + 1:
                raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray._private.node, "Node", NodeMissingItsFirstStart)
    monkeypatch.setattr(da_cluster, "stop_ray_leftovers", lambda: stopped.append(len(started)))
    failures = 1
    head = da_cluster.start_head(spec, "127.0.0.1:43210")
    assert isinstance(head, NodeMissingItsFirstStart)
    assert started == [(43210, True), (43210, True)] and stopped == [1]

    started.clear(), stopped.clear()
    failures = da_cluster.NODE_START_TRIES
    with pytest.raises(Exception, match="timed out during startup"):
        da_cluster.start_head(spec, "127.0.0.1:43210")
    assert len(started) == da_cluster.NODE_START_TRIES and stopped == list(range(1, da_cluster.NODE_START_TRIES))
