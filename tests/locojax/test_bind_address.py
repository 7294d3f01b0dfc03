"""The bind shim (locojax/_bind_shim.c, locojax.bind_address): a process re-executed bound to an
address keeps its PID and listens there and nowhere else, and so does the Ray a DA run's head starts."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from locojax import bind_address
from tests.locojax.test_co import ROOT


def _routable_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    found = [line.split()[3].split("/")[0] for line in shown.splitlines()]
    return next((a for a in found if not a.startswith("127.")), None)


ADDRESS = _routable_address()
pytestmark = [
    pytest.mark.skipif(bind_address.shim_path() is None, reason="the bind shim was not built"),
    pytest.mark.skipif(ADDRESS is None, reason="no routable address on this machine"),
]

CHILD = textwrap.dedent("""
    import os, socket, sys
    from locojax import bind_address
    pid = os.getpid()
    bind_address.reexecute_bound_to(sys.argv[1])
    servers = []
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        server = socket.socket(family)
        server.bind((wildcard, 0))
        server.listen()
        servers.append(server)
    udp = socket.socket(type=socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))  # only TCP is rewritten
    print(pid, os.getpid(), bind_address.bound(), *(s.getsockname()[1] for s in servers), udp.getsockname()[0],
          flush=True)
    sys.stdin.read()
""")


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def test_a_wildcard_listener_of_a_bound_process_answers_at_its_address_only():
    child = subprocess.Popen([sys.executable, "-c", CHILD, ADDRESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pid_before, pid_after, bound, port4, port6, udp = child.stdout.readline().split()
        assert pid_before == pid_after == str(child.pid)  # re-executed in place
        assert bound == ADDRESS and udp == "0.0.0.0"
        for port in (int(port4), int(port6)):
            assert _connects(ADDRESS, port)
            assert not _connects("127.0.0.1", port)
    finally:
        child.communicate("", timeout=30)
    assert child.returncode == 0


# The run's head on this machine's routable address, as `locojax train --listen` starts it, with one
# actor; prints "program pid local-address" for every TCP listener of its process tree (the GCS and
# raylet it starts, the workers those start), then stops it.
HEAD = textwrap.dedent("""
    import os, re, subprocess, sys
    from locojax import bind_address
    from locojax.launch import free_port
    from locojax.modes import da_cluster
    from locojax.spec import RunSpec

    bind_address.reexecute_bound_to(sys.argv[1])
    spec = RunSpec.model_validate({"placement": {"mode": "da", "hosts": 2, "rollout_fraction": 0.5}})
    da_cluster.use_secret_as_token(sys.argv[2])
    listen = f"{sys.argv[1]}:{free_port()}"
    head = da_cluster.start_head(spec, listen)
    import ray

    @ray.remote(num_cpus=0)
    class Actor:
        def ping(self):
            return os.getpid()

    ray.init(address=listen, _node_ip_address=sys.argv[1], log_to_driver=False, configure_logging=False)
    ray.get(Actor.remote().ping.remote(), timeout=120)
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        tree.update(frontier)
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines():
        for program, pid in re.findall(r'"([^"]+)",pid=(\\d+)', line):
            if int(pid) in tree:
                print(program, pid, line.split()[3], flush=True)
    ray.shutdown()
    head.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    da_cluster.stop_ray_leftovers()
""")


@pytest.mark.multiprocess
def test_every_listener_of_a_da_heads_ray_is_at_the_heads_address(tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "LD_PRELOAD", "LOCOJAX_BIND"))}
    done = subprocess.run([sys.executable, "-c", HEAD, ADDRESS, str(secret)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    listeners = [line.split() for line in done.stdout.splitlines() if line.strip()]
    assert {"gcs_server", "raylet"} <= {program for program, _, _ in listeners}
    assert len(listeners) >= 5  # GCS, 2 raylet, the driver's and the actor's core workers (and agents)
    for program, pid, local in listeners:
        assert local.rsplit(":", 1)[0] in (ADDRESS, f"[::ffff:{ADDRESS}]"), (program, pid, local)
