"""The Ray cluster of a DA run across its reserved hosts (locojax.modes.da_cluster): its token is the
attempt's secret, so a client without it (or with another) is refused, and the layout that gives
every reserved host its process and group."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
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


def _start_client(address: str, **settings: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | settings
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, "-c", CLIENT, address], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(client: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = client.communicate(timeout=180)
    return subprocess.CompletedProcess(client.args, client.returncode, stdout, stderr)


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
        # The three clients side by side: a refused one gives up only after Ray's ~20 s of connection
        # retries, which two of them would otherwise sit out one after the other. A refused client can
        # also end up waiting for the GCS "to become available" for as long as Ray lets a GCS request
        # take: Ray's own 60 s for those two, not the 180 s tests/conftest.py gives runs under load
        # (with it, one outlived _finish's 180 s once).
        refused_wait = {"RAY_gcs_server_request_timeout_seconds": "60"}
        clients = [_start_client(address, **refused_wait),
                   _start_client(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(other), **refused_wait),
                   _start_client(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(secret))]
        try:
            refused, wrong, admitted = [_finish(client) for client in clients]
        finally:
            for client in clients:  # one that timed out, and those not waited for after it
                if client.poll() is None:
                    client.kill()
                    client.wait()
        assert refused.returncode != 0 and "ran" not in refused.stdout and "token" in refused.stderr
        assert wrong.returncode != 0 and "ran" not in wrong.stdout and "token" in wrong.stderr.lower()
        assert admitted.returncode == 0 and admitted.stdout.strip().endswith("ran"), admitted.stderr[-2000:]
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
