"""Every wildcard TCP listener of a process and of all it starts, bound to one address instead.

Ray 2.60 has no setting that names the address its gRPC servers listen on: the GCS, the raylet (node
manager and object manager) and every core worker (the driver, actors, idle workers) bind 0.0.0.0 /
:: whenever their node's address is not loopback, and 127.0.0.1 only when it is. A DA run's Ray under
the control plane spans its reserved hosts, so its node address is the worker's routable `--address`.
Its processes therefore run with `_bind_shim` (locojax/_bind_shim.c, built with the package) preloaded
and `LOCOJAX_BIND_ADDRESS` set to that address: the shim rewrites a bind() to the wildcard address
into one to the node's address, so Ray's ports answer at the address the hosts advertise and at no
other (not on loopback, not on any other interface of the host). `reexecute_bound_to` re-executes the
engine process in place (same PID, parent-death signal kept: nothing changes its credentials) with
both set; Ray passes its environment on to the GCS, raylet, agents and workers it starts.

Where the shim was not built (no C compiler at install time) the run goes on and says so on stderr:
its Ray ports are then on every interface, guarded by the attempt's token alone.
"""

from __future__ import annotations

import importlib.machinery
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Sequence

ADDRESS_ENV = "LOCOJAX_BIND_ADDRESS"  # read by the shim
PRELOAD_ENV = "LD_PRELOAD"


def shim_path() -> Path | None:
    """The built shim (an extension-module file name, though it is never imported), or None."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_bind_shim{suffix}"
        if candidate.is_file():
            return candidate
    return None


def resolve(address: str) -> str:
    """The IP address a host address (a literal or a name) stands for."""
    try:
        return str(ipaddress.ip_address(address.strip("[]")))
    except ValueError:
        return socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0]


def bound() -> str | None:
    """The address this process's wildcard listeners are bound to, when the shim is loaded here."""
    path = shim_path()
    preloaded = os.environ.get(PRELOAD_ENV, "").replace(":", " ").split()
    if path is None or str(path) not in preloaded:
        return None
    return os.environ.get(ADDRESS_ENV) or None


def reexecute_bound_to(address: str, argv: Sequence[str] | None = None) -> None:
    """Replace this process by the same command (`argv`, default this one) with the shim preloaded
    and bound to `address`; returns when that is already so, when `address` is loopback (Ray keeps
    to loopback by itself then), or when the shim is missing, after saying so on stderr."""
    ip = resolve(address)
    if ipaddress.ip_address(ip).is_loopback or bound() is not None:
        return  # loopback, or this is the re-executed process
    path = shim_path()
    if path is None:
        print(f"warning: locojax was installed without its bind shim (no C compiler?); this run's Ray "
              f"listens on every interface of this host, not only {ip}, guarded by the attempt's token only",
              file=sys.stderr, flush=True)
        return
    preload = " ".join(filter(None, (str(path), os.environ.get(PRELOAD_ENV, ""))))
    env = {**os.environ, ADDRESS_ENV: ip, PRELOAD_ENV: preload}
    # A raylet started with RAY_LD_PRELOAD_ON_WORKERS=0 unsets LD_PRELOAD for the workers it starts.
    # (With LD_PRELOAD set, Ray does not preload its jemalloc into the GCS and raylet: glibc's malloc.)
    env.pop("RAY_LD_PRELOAD_ON_WORKERS", None)
    from locojax.private_network import this_command

    command = this_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)
