"""The private network namespace a DA run's own Ray lives in: what listens inside is reachable from
inside only, and the re-executed process keeps its PID and its parent-death signal."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from locojax import private_network

pytestmark = pytest.mark.skipif(private_network.available() is not None,
                                reason=f"no private network namespace here: {private_network.available()}")

CHILD = textwrap.dedent("""
    import os, socket, sys
    from locojax import private_network
    pid = os.getpid()
    private_network.reexecute_inside()
    private_network.loopback_up()
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    port = server.getsockname()[1]
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # reachable from inside
    print(pid, os.getpid(), private_network.namespace_id(), private_network._parent_death_signal(), port,
          flush=True)
    sys.stdin.read()  # hold the port open until the test has tried it
""")


def _host_addresses() -> list[str]:
    names = {socket.gethostname(), "localhost"}
    found = {"127.0.0.1"}
    for name in names:
        try:
            found |= {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
        except socket.gaierror:
            pass
    return sorted(found)


def test_a_port_opened_inside_is_closed_to_every_address_of_the_host():
    def arm_parent_death_signal() -> None:
        ctypes.CDLL("libc.so.6").prctl(private_network.PR_SET_PDEATHSIG, signal.SIGKILL)

    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, preexec_fn=arm_parent_death_signal)
    try:
        line = child.stdout.readline().split()
        assert line, "the child printed nothing"
        pid_before, pid_after, namespace, death_signal, port = line
        assert pid_before == pid_after == str(child.pid)  # re-executed in place, as the worker sees it
        assert namespace != private_network.namespace_id()
        assert int(death_signal) == signal.SIGKILL  # re-armed after entering the user namespace
        for address in _host_addresses():
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, int(port)), timeout=5).close()
    finally:
        child.communicate("", timeout=30)
    assert child.returncode == 0


def test_inside_is_false_in_the_hosts_own_namespace(monkeypatch):
    assert not private_network.inside()
    monkeypatch.setenv(private_network.INSIDE_ENV, f"{private_network.namespace_id()} 0")
    assert not private_network.inside()  # a copied variable does not make a process isolated
