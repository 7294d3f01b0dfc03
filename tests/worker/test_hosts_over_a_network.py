"""Hosts that talk over a real network interface: three workers, each in a network namespace of its
own joined to the machine's by a veth pair and a bridge, so everything between hosts (the SC
controller's dispatch and gather, the workers' jax.distributed collectives, each worker's reports to
the API) crosses an interface, not the loopback. Root only (`ip netns`); skipped elsewhere.

The broker is the embedded SQLite one (a file every namespace sees); the API listens on the bridge.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from locojax.client import ApiClient
from locojax.launch import free_port
from server.embedded import ControlPlane, start
from tests.conftest import session_processes
from tests.e2e import netns
from tests.e2e.helpers import steps_of, tiny_spec, wait_final, wait_until
from tests.worker.planes import plane_settings, stop_leaving_nothing

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres]

HOSTS = 3


@pytest.fixture(scope="module")
def hosts() -> Iterator[netns.NamespacedHosts]:
    why = netns.available()
    if why:
        pytest.skip(why)
    namespaced = netns.NamespacedHosts(HOSTS).create()
    try:
        yield namespaced
    finally:
        namespaced.destroy()


@pytest.fixture(scope="module")
def plane(postgres_url: str, hosts: netns.NamespacedHosts, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("netplane")
    settings = plane_settings(tmp, postgres_url, f"sqla+sqlite:///{tmp / 'broker.sqlite'}")
    control_plane = start(settings, hosts=HOSTS, port=free_port(), api_host=hosts.machine_address,
                          worker_prefixes=[hosts.prefix(i) for i in range(HOSTS)],
                          worker_addresses=[hosts.address(i) for i in range(HOSTS)])
    yield control_plane
    stop_leaving_nothing(control_plane)


def _namespace_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


# Per mode, a metric every host reports each step: CO hosts their own step, SC workers their own sampling.
PER_HOST_METRIC = {"co": "time/step", "sc": "sc/worker_sample"}


@pytest.mark.parametrize("mode", ["co", "sc"])
def test_a_run_across_three_namespaced_hosts_crosses_the_network(plane: ControlPlane, hosts: netns.NamespacedHosts,
                                                                  mode: str):
    with plane.client() as api:
        steps = 3
        spec = tiny_spec(f"net-{mode}", hosts=HOSTS, steps=steps,
                         placement={"mode": mode, "hosts": HOSTS, "devices_per_host": 1}, debug={"checksum_every": 1})
        spec["rollout"]["prompts_per_step"] = 2 * HOSTS
        run = api.submit(spec)

        def running() -> list[dict] | None:
            rows = api.list_run_hosts(run["id"])
            return rows if len(rows) == HOSTS and all(r["pid"] and r["status"] == "RUNNING" for r in rows) else None

        rows = wait_until(running, 240, "every process to run")
        # Three processes in three different namespaces, none in the machine's: the traffic between them
        # (gloo's all-reduce; SC's controller link) can only go over the veth pairs and the bridge.
        spaces = {_namespace_of(r["pid"]) for r in rows}
        assert len(spaces) == HOSTS and _namespace_of(os.getpid()) not in spaces
        # What the engines listen on (process 0's JAX coordinator, SC's controller link, gloo's pairs) is
        # at their host's own address, never on every interface (nor on a loopback other hosts can't use).
        for row in rows:
            host = hosts.host_of(row["pid"])
            listening = {address for address, _ in netns.listening(row["pid"])}
            assert listening <= {hosts.address(host)}, (row["host_name"], listening)
        final = wait_final(api, run["id"])
        assert final["status"] == "SUCCEEDED", final["status_reason"]
        for host in range(HOSTS):
            assert steps_of(api, run["id"], PER_HOST_METRIC[mode], host) == list(range(steps)), host
        checksums = {tuple(api.metric_history(run["id"], ["params/checksum"], hosts=[h])["series"][0]["last"])
                     for h in range(HOSTS)}
        assert len(checksums) == 1
        assert wait_until(lambda: not session_processes("locojax.cli sc-worker") and
                          not session_processes("locojax.cli host"), 10, "the engine processes to exit")
