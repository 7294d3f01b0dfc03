"""Simulated hosts that talk over a real network interface: one network namespace per host, joined by
veth pairs to a bridge in the machine's namespace (root only; `ip netns`, no netem).

    machine namespace: bridge <name>br, 10.<net>.0.1/24  (the API listens here)
    host i:            namespace <name>-<i>, veth peer 10.<net>.0.<10+i>/24, its own loopback

`ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts for the command it runs, so the
machine's host name resolves to the namespace's own address there: gloo (jax.distributed's CPU
collectives) binds to the address the host name resolves to.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def available() -> str | None:
    """Why namespaced hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
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


@dataclass
class NamespacedHosts:
    name: str  # short: interface names are limited to 15 characters
    count: int
    net: int = 231  # the second octet of 10.x.0.0/24
    namespaces: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    @property
    def machine_address(self) -> str:
        return f"10.{self.net}.0.1"

    def address(self, host: int) -> str:
        return f"10.{self.net}.0.{10 + host}"

    def host_of(self, pid: int) -> int:
        """The host whose namespace process `pid` runs in."""
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        return next(host for host, namespace in enumerate(self.namespaces)
                    if os.stat(f"/run/netns/{namespace}").st_ino == inode)

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a process inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def create(self) -> "NamespacedHosts":
        self.destroy()  # what an interrupted earlier run left behind
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.machine_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in range(self.count):
            namespace, outside, inside = f"{self.name}-{host}", f"{self.name}v{host}", f"{self.name}p{host}"
            _ip("netns", "add", namespace)
            self.namespaces.append(namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.address(host)} {socket.gethostname()}\n")
        return self

    def destroy(self) -> None:
        for host in range(self.count):
            namespace = f"{self.name}-{host}"
            _ip("netns", "pids", namespace, check=False)
            pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("link", "del", f"{self.name}v{host}", check=False)  # removes its peer too
            _ip("netns", "del", namespace, check=False)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        self.namespaces = []


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
