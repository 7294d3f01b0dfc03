"""Simulated hosts that talk over a real network interface (root only; `ip netns`, no netem): one network
namespace per host, each with one veth interface `eth0` on a bridge in the machine's namespace, so
traffic between "hosts" crosses an interface, as between machines.

    machine namespace: bridge lcjbr<tag>, <subnet>.254/24  (`machine_address`: an API listening here)
    host i:            namespace lcj<tag>h<i>, eth0 <subnet>.<i+1>/24, its own loopback

    with NamespacedHosts(3) as hosts:            # namespaces, veths, the bridge; removed on exit
        hosts.address(0)                         # host 0's address in its namespace
        hosts.command(0, [...])                  # [...] run inside host 0's namespace
        hosts.prefix(0)                          # the same as a command prefix (`ip netns exec NS`)

Each instance takes a random tag, so concurrent test runs do not share names. `ip netns exec`
bind-mounts /etc/netns/<ns>/hosts over /etc/hosts for the command it runs, so the machine's host name
resolves to the namespace's own address there: gloo (jax.distributed's CPU collectives) binds to the
address the host name resolves to. A service left on the machine's loopback (a broker) is reachable
from the hosts through a `Forwarder` on the bridge's address.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import threading
from pathlib import Path


def available() -> str | None:
    """Why namespaced hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces with veth pairs need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is missing"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class NamespacedHosts:
    def __init__(self, count: int):
        tag = secrets.token_hex(2)  # interface names are limited to 15 characters
        self.count, self.subnet = count, f"10.247.{int(tag, 16) % 250}"
        self.bridge = f"lcjbr{tag}"
        self.namespaces = [f"lcj{tag}h{i}" for i in range(count)]
        self._veths = [f"lcj{tag}v{i}" for i in range(count)]

    @property
    def machine_address(self) -> str:
        """The machine's own address on the hosts' bridge."""
        return f"{self.subnet}.254"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a process inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def command(self, host: int, argv: list[str]) -> list[str]:
        return [*self.prefix(host), *argv]

    def namespace_id(self, host: int) -> str:
        """The kernel's id of host `host`'s network namespace, as /proc/<pid>/ns/net shows it."""
        return subprocess.run(self.command(host, ["readlink", "/proc/self/ns/net"]), capture_output=True, text=True,
                              check=True).stdout.strip()

    def host_of(self, pid: int) -> int:
        """The host whose namespace process `pid` runs in."""
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        return next(host for host, namespace in enumerate(self.namespaces)
                    if os.stat(f"/run/netns/{namespace}").st_ino == inode)

    def interface_bytes(self, host: int) -> int:
        """Bytes received plus sent on host `host`'s one outward interface (its veth end, `eth0`)."""
        statistics = "/sys/class/net/eth0/statistics"
        out = subprocess.run(self.command(host, ["cat", f"{statistics}/rx_bytes", f"{statistics}/tx_bytes"]),
                             capture_output=True, text=True, check=True)
        return sum(int(value) for value in out.stdout.split())

    def create(self) -> "NamespacedHosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.machine_address}/24", "dev", self.bridge)
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
                etc = Path("/etc/netns") / namespace
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.address(host)} {socket.gethostname()}\n")
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self) -> None:
        """Stop what still runs in the namespaces, then remove them, their veths and the bridge."""
        for namespace in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", namespace, check=False)  # the veth ends inside go with it, and their peers
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        for veth in self._veths:
            _ip("link", "del", veth, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> "NamespacedHosts":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (IPv4-mapped IPv6 as IPv4)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order 32-bit words
            if width == 32 and words[:12] == b"\0" * 10 + b"\xff\xff":
                words = words[12:]
            found.add((".".join(map(str, words)) if len(words) == 4 else words.hex(), int(port, 16)))
    return found


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
