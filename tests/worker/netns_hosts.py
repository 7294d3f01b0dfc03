"""Hosts with networks of their own on one machine (root only): N network namespaces, each with one
veth interface on a bridge in the machine's namespace, so traffic between "hosts" crosses a real
network interface, as between machines. The control plane's API and broker stay in the machine's
namespace on loopback; `Forwarder` makes them reachable at the bridge's address.

    with NetnsHosts(3) as hosts:                 # namespaces, veths, the bridge; removed on exit
        hosts.address(0)                         # "10.247.7.1": host 0's address in its namespace
        hosts.command(0, [...])                  # [...] run inside host 0's namespace
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import threading


def available() -> str | None:
    """None when this process may create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces with veth pairs need root"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"`ip netns` failed: {probe.stderr.strip()}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetnsHosts:
    def __init__(self, count: int):
        tag = secrets.token_hex(2)
        self.count, self.subnet = count, f"10.247.{int(tag, 16) % 250}"
        self.bridge = f"lcjbr{tag}"
        self.namespaces = [f"lcj{tag}h{i}" for i in range(count)]
        self._veths = [f"lcj{tag}v{i}" for i in range(count)]

    @property
    def bridge_address(self) -> str:
        return f"{self.subnet}.254"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def interface_bytes(self, host: int) -> int:
        """Bytes received plus sent on host `host`'s one outward interface (its veth end, `eth0`)."""
        statistics = "/sys/class/net/eth0/statistics"
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[host], "cat", f"{statistics}/rx_bytes",
                              f"{statistics}/tx_bytes"], capture_output=True, text=True, check=True)
        return sum(int(value) for value in out.stdout.split())

    def namespace_id(self, host: int) -> str:
        """The kernel's id of host `host`'s network namespace, as /proc/<pid>/ns/net shows it."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[host], "readlink", "/proc/self/ns/net"],
                              capture_output=True, text=True, check=True).stdout.strip()

    def __enter__(self) -> "NetnsHosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host, (namespace, veth) in enumerate(zip(self.namespaces, self._veths)):
                _ip("netns", "add", namespace)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                _ip("link", "set", f"{veth}p", "netns", namespace)
                _ip("-n", namespace, "link", "set", f"{veth}p", "name", "eth0")
                _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for namespace in self.namespaces:  # the veth ends inside go with it, and their peers with them
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        for veth in self._veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class Forwarder:
    """TCP from `listen` to `target` (both (address, port)), in threads, until `close`."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.target = target
        self.server = socket.create_server(listen)
        self.closed = False
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name=f"forward-{listen[1]}").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                continue
            self.connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.server.close()
        for connection in self.connections:
            try:
                connection.close()
            except OSError:
                pass
