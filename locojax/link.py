"""An authenticated message link between the processes of one run over TCP (SC's controller and its
workers).

`multiprocessing.connection` does the framing and an HMAC challenge with the attempt's shared secret
before anything is unpickled, so a process that does not hold the secret cannot send a message; only
after that are messages (dicts of numpy arrays, lists and numbers) pickled. The secret comes from a
file (the control plane's `--secret-file`, 0600) and never appears on a command line.
"""

from __future__ import annotations

import secrets
import socket
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any, Callable

SECRET_BYTES = 32


class LinkError(RuntimeError):
    """The other end went away, or did not answer in time."""


class LinkLost(LinkError):
    """The other end went away: its side of the connection closed (its process died or exited)."""


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def read_secret(path: str | Path) -> bytes:
    text = Path(path).read_text(encoding="utf-8").strip()
    if len(text) < 32:
        raise ValueError(f"{path}: the run's secret is missing or too short")
    return text.encode()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not an ADDR:PORT address: {address!r}")
    return host, int(port)


def listen(address: str, secret: bytes, backlog: int = 64) -> Listener:
    return Listener(split_address(address), family="AF_INET", backlog=backlog, authkey=secret)


def accept(listener: Listener, count: int, timeout_s: float, alive: Callable[[], str | None] = lambda: None
           ) -> list[Connection]:
    """Accept `count` authenticated connections within `timeout_s`. `alive()` is asked between
    attempts and returns why waiting is pointless (a started process died), or None. A connection
    that fails the handshake (no secret) is dropped and does not count."""
    sock: socket.socket = listener._listener._socket  # type: ignore[attr-defined]
    sock.settimeout(1.0)
    deadline = time.monotonic() + timeout_s
    connections: list[Connection] = []
    while len(connections) < count:
        why = alive()
        if why:
            raise LinkError(why)
        if time.monotonic() > deadline:
            raise LinkError(f"{len(connections)} of {count} process(es) connected within {timeout_s:g} s")
        try:
            connections.append(listener.accept())
        except socket.timeout:
            continue
        except Exception:  # noqa: BLE001  (a peer without the secret: AuthenticationError, EOF, reset)
            continue
    return connections  # accepted sockets are blocking again (multiprocessing sets them so)


def connect(address: str, secret: bytes, timeout_s: float) -> Connection:
    """Connect to `address`, retrying until it listens (it may start after us) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(split_address(address), family="AF_INET", authkey=secret)
        except (ConnectionRefusedError, ConnectionResetError, socket.timeout, OSError) as exc:
            if time.monotonic() > deadline:
                raise LinkError(f"could not reach {address} within {timeout_s:g} s: {exc}") from None
            time.sleep(0.2)


def receive(connection: Connection, timeout_s: float, what: str) -> Any:
    """The next message, or LinkError naming `what` when the peer is gone or silent for `timeout_s`."""
    try:
        if not connection.poll(timeout_s):
            raise LinkError(f"no answer within {timeout_s:g} s ({what})")
        return connection.recv()
    except (EOFError, ConnectionError, OSError) as exc:
        raise LinkLost(f"connection lost ({what}): {exc.__class__.__name__}") from None


def send(connection: Connection, message: Any, what: str) -> None:
    try:
        connection.send(message)
    except (EOFError, ConnectionError, OSError) as exc:
        raise LinkLost(f"connection lost ({what}): {exc.__class__.__name__}") from None
