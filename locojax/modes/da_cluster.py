"""DA across the hosts a run reserved: one Ray cluster per attempt, spanning those hosts only.

Under the control plane a DA run with `placement.hosts = H` starts one engine process on each of its
H reserved hosts (locojax.modes: DA's layout):
  * process 0, on the first reserved host, is the driver (`locojax train --listen ADDR:PORT`): it
    starts the Ray head there, its GCS on the address and port its worker published, and hosts train
    host 0's actor on that node;
  * every other process (`locojax ray-node`) starts a Ray node on its own host that joins that head.

Reserved host h is train host h for h < T (T = hosts - rollout hosts, `rollout_fraction`) and
rollout host h - T otherwise: the driver sits with train host 0, so the batch it assembles reaches
the trainer without crossing the network, and weights leave that host once per step. Each node
advertises its group's resource (`locojax_train` / `locojax_rollout`) and one naming its host
(`locojax_host_<h>`), so every actor lands on exactly the host the run's layout gave it, and as many
CPUs as its worker's cores: the node, its raylet and the actors' worker processes inherit the
worker's pinning.

Every Ray process binds to its host's address (Ray's node IP, the worker's `--address`). Ray 2.60
opens its gRPC servers on every interface of a host with a routable node address and has no setting
against it, so `locojax train --listen` and `locojax ray-node` re-execute themselves with
locojax.bind_address's shim preloaded: every wildcard listener of the driver, the node processes and
all Ray starts (GCS, raylets, agents, workers) is bound to that address instead. The cluster is also
guarded by Ray's token auth, under the attempt's shared secret: it reaches every process
as a 0600 file (`--secret-file`), which Ray reads through `RAY_AUTH_TOKEN_PATH`; the token itself is
never in an environment, a command line or a log, and nothing is written to the home directory.

A node process lives exactly as long as the head: when the driver shuts the cluster down (success,
failure, cancel) the GCS closes its port, and every node process stops its Ray processes and exits 0;
the driver's exit code is the run's outcome. A node process that is killed takes its Ray processes
with it (Ray's kernel fate sharing); a Ray process of a node that dies ends the node process with
exit code 1, naming it, and the driver reports the actor that lived there.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from locojax.link import split_address
from locojax.modes.errors import DAError
from locojax.spec import RunSpec

RESOURCE_ROLLOUT = "locojax_rollout"
RESOURCE_TRAIN = "locojax_train"
JOIN_TIMEOUT_S = 180.0  # the head to come up for a node, every node to join for the driver
GCS_POLL_S = 0.5
# A node sees the head gone after this many refused connections in a row (one refusal could be a
# listen backlog overflow; a closed port refuses every time).
GCS_GONE_AFTER = 3
NODE_START_TRIES = 3  # a loaded machine can miss Ray's fixed start-up wait for a raylet


def host_resource(host: int) -> str:
    """The resource only reserved host `host`'s node advertises."""
    return f"locojax_host_{host}"


def train_host_count(spec: RunSpec) -> int:
    return spec.placement.hosts - spec.placement.rollout_hosts


def is_train_host(spec: RunSpec, host: int) -> bool:
    return host < train_host_count(spec)


def node_resources(spec: RunSpec, host: int) -> dict[str, float]:
    group = RESOURCE_TRAIN if is_train_host(spec, host) else RESOURCE_ROLLOUT
    return {group: 1.0, host_resource(host): 1.0}


def use_secret_as_token(secret_file: str | Path) -> None:
    """Token auth under the attempt's secret, for this process and the Ray processes it starts; set
    before `import ray` (Ray reads its auth mode when it is imported). Only the file's path is in the
    environment, never the token."""
    path = Path(secret_file).resolve()
    if not path.is_file() or not path.read_text(encoding="utf-8").strip():
        raise FileNotFoundError(f"--secret-file {secret_file}: no secret there")
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    os.environ.pop("RAY_AUTH_TOKEN", None)


def connect_as_driver(listen: str) -> None:
    """Before `import ray` in the driver: Ray rewrites a loopback address the driver connects to into the
    machine's outward address, where a cluster of hosts on one machine (workers on 127.0.0.1) does not
    listen; this setting of Ray's makes it keep loopback as it is."""
    import ipaddress

    host = split_address(listen)[0]
    if host == "localhost" or ipaddress.ip_address(host).is_loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def gcs_listening(address: str, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection(split_address(address), timeout=timeout_s):
            return True
    except OSError:
        return False


def stop_ray_leftovers() -> list[int]:
    """SIGKILL the Ray processes left in this process's group once its Ray node was stopped: a raylet
    that goes after the head took its GCS leaves agents behind that wait for that GCS forever. Only
    Ray's own processes (its programs, its `ray::` workers and agents) of this group; the pids."""
    import signal

    import ray

    ray_dir, group, killed = os.path.dirname(ray.__file__), os.getpgrp(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != group:
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if command.startswith("ray::") or ray_dir in command:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return killed


def _node_params(spec: RunSpec, host: int, node_ip: str, **extra):
    import ray._private.parameter

    return ray._private.parameter.RayParams(
        node_ip_address=node_ip, node_name=f"locojax-host-{host}", num_cpus=len(os.sched_getaffinity(0)), num_gpus=0,
        resources=node_resources(spec, host), include_dashboard=False, **extra)


def start_head(spec: RunSpec, listen: str):
    """Start this run's Ray head here (reserved host 0), its GCS on `listen`; returns the Ray node,
    whose `kill_all_processes` ends it. Call `use_secret_as_token` first."""
    import ray._private.node

    node_ip, port = split_address(listen)

    def start():
        # No autoscaler monitor: a run's cluster is exactly its reserved hosts (the monitor would also open
        # a metrics port of its own, the same fixed one for every run on the machine).
        params = _node_params(spec, 0, node_ip, num_redis_shards=None, redis_max_clients=None, no_monitor=True)
        params.gcs_server_port = port
        # Not `shutdown_at_exit`: the driver kills the node itself once its actors are gone; if the
        # driver dies first, the node's processes die with it (the reaper, kernel fate sharing).
        return ray._private.node.Node(params, head=True, shutdown_at_exit=False, spawn_reaper=True)

    for attempt in range(1, NODE_START_TRIES):
        try:
            return start()
        except Exception as exc:  # as a node's (serve_node): Ray's fixed start-up waits, on a loaded machine
            stop_ray_leftovers()  # the half-started GCS and raylet, so the next try gets the port
            print(f"Ray head start {attempt} failed ({exc}); trying again", file=sys.stderr, flush=True)
    return start()


def wait_for_nodes(ray, spec: RunSpec, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Until every reserved host's node has joined; raises naming the hosts still missing."""
    wanted = {host_resource(h): h for h in range(spec.placement.hosts)}
    deadline = time.monotonic() + timeout_s
    while True:
        present = ray.cluster_resources()
        missing = sorted(h for name, h in wanted.items() if present.get(name, 0) < 1)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise DAError(f"reserved host(s) {', '.join(map(str, missing))}: no Ray node joined the run's head "
                          f"in {timeout_s:.0f} s")
        time.sleep(0.2)


def serve_node(spec: RunSpec, head: str, node_ip: str, host: int, secret_file: str | Path) -> int:
    """Run reserved host `host`'s Ray node until the run's head is gone; the exit code: 0 when the
    head went away (the driver ended the run), 1 when a Ray process of this node died under it."""
    use_secret_as_token(secret_file)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not gcs_listening(head):
        if time.monotonic() > deadline:
            print(f"host {host}: the run's Ray head at {head} did not come up in {JOIN_TIMEOUT_S:.0f} s",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(GCS_POLL_S)
    import ray._private.node

    for attempt in range(1, NODE_START_TRIES + 1):
        params = _node_params(spec, host, node_ip, gcs_address=head)
        try:
            # shutdown_at_exit: a SIGTERM from the worker (the run moved on) or a normal exit stops this
            # node's Ray processes; a SIGKILL takes them along through the kernel's fate sharing.
            node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
            break
        except Exception as exc:  # Ray 2.60 gives its raylet 30 s to register, a bare Exception after
            stop_ray_leftovers()
            if attempt == NODE_START_TRIES or not gcs_listening(head):
                raise
            print(f"host {host}: Ray node start {attempt} failed ({exc}); trying again", file=sys.stderr, flush=True)
    group = "train" if is_train_host(spec, host) else "rollout"
    print(f"host {host}: Ray node ({group}) at {node_ip} joined the run's head at {head}", flush=True)
    refused = 0
    while True:
        time.sleep(GCS_POLL_S)
        refused = 0 if gcs_listening(head) else refused + 1
        if refused >= GCS_GONE_AFTER:
            node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
            stop_ray_leftovers()
            print(f"host {host}: the run's Ray head is gone; this node stopped", flush=True)
            return 0
        dead = [name for name, process in node.dead_processes()]
        if dead and not gcs_listening(head):
            refused = GCS_GONE_AFTER - 1  # a raylet may go first when the head went down: settle on the next poll
        elif dead:
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            stop_ray_leftovers()
            print(f"host {host}: Ray process(es) {', '.join(dead)} of this node died; node stopped",
                  file=sys.stderr, flush=True)
            return 1
