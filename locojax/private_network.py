"""A process's own network namespace, holding only a loopback interface, for a run's private Ray.

Ray 2.60's GCS, raylet and worker gRPC servers listen on every interface of the network they start
in (only a loopback node address keeps them on loopback; locojax.modes.da keeps it), and no setting
of that release binds them to one routable address (locojax.bind_address does it for a run that
spans hosts). A DA run that starts its own Ray on one machine also runs in a fresh network
namespace: `unshare --net --map-root-user` (a user namespace, so it works without root where the
kernel allows unprivileged user namespaces) re-executes the same command in the same process, so
the worker's PID, stdout pipe, parent-death signal and files stay as they were. Inside, only `lo`
exists, so every Ray port is reachable from this run's processes and from nothing else on the
machine or the network; Ray's per-run token stays on as a second guard.

A DA run under the control plane spans the hosts it reserved, so its Ray must be on their network:
it stays in the host's namespace, its listeners bound to its host's address (locojax.bind_address)
and guarded by the attempt's secret as Ray's token (locojax.modes.da_cluster).

Where the kernel refuses the namespace (unprivileged user namespaces disabled), the run goes on in
the host's network and says so on stderr: its Ray ports are then on 127.0.0.1 only (open to the
machine's other local users), guarded by the token.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from typing import Sequence

# Set in the re-executed process, so it knows it is inside and does not re-execute again:
# "<the host's namespace id> <parent-death signal>". Entering a user namespace changes the process's
# credentials, which makes the kernel clear its parent-death signal (the worker's guard against
# orphaned engines), so the re-executed process arms it again.
INSIDE_ENV = "LOCOJAX_PRIVATE_NETWORK"
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2

_UNSHARE = ("--net", "--map-root-user", "--")


def namespace_id(pid: int | str = "self") -> str:
    """The network namespace of a process, as the kernel names it (`net:[4026531840]`)."""
    return os.readlink(f"/proc/{pid}/ns/net")


def inside() -> bool:
    host_namespace = os.environ.get(INSIDE_ENV, "").split(" ")[0]
    return bool(host_namespace) and host_namespace != namespace_id()


def _prctl(option: int, value: int | ctypes.c_int | ctypes._Pointer = 0) -> int:
    return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)


def _parent_death_signal() -> int:
    signal = ctypes.c_int(0)
    _prctl(PR_GET_PDEATHSIG, ctypes.pointer(signal))
    return signal.value


def available() -> str | None:
    """None when this process may create a private network namespace, else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "the `unshare` program (util-linux) is not installed"
    probe = subprocess.run([unshare, *_UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`unshare --net --map-root-user` failed: {probe.stderr.strip() or probe.returncode}"
    return None


def this_command(argv: Sequence[str] | None = None) -> list[str]:
    """The command that re-executes this process (`argv` when given): orig_argv keeps `-m locojax.cli`,
    which sys.argv has already turned into a file path."""
    return list(argv) if argv is not None else [sys.executable, *sys.orig_argv[1:]]


def reexecute_inside(argv: Sequence[str] | None = None) -> None:
    """Replace this process by the same command (`argv`, default this one) in a private network
    namespace; returns only when that is impossible, after saying why on stderr."""
    if inside():
        signal = int(os.environ[INSIDE_ENV].split(" ")[1])
        if signal:
            _prctl(PR_SET_PDEATHSIG, signal)
        return
    reason = available()
    if reason is not None:
        print(f"warning: no private network for this run's Ray ({reason}); its ports listen on this "
              "machine's loopback, guarded by its per-run token only", file=sys.stderr, flush=True)
        return
    command = this_command(argv)
    env = {**os.environ, INSIDE_ENV: f"{namespace_id()} {_parent_death_signal()}"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe("unshare", ["unshare", *_UNSHARE, *command], env)


def loopback_up() -> None:
    """Bring up `lo`, which a new network namespace starts with down (root in the user namespace may)."""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
