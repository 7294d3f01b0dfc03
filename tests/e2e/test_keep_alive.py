"""The API keeps an idle keep-alive connection open longer than pooled HTTP clients keep theirs.

httpx pools idle connections for 5 s, and uvicorn's default closes them after 5 s: a client reusing a
connection as the server closes it gets ReadError (7 of 2,121 requests of the 50-client load test
once did). `Settings.keep_alive_s` (75 s) closes that window; this checks the running API process
honours it with a plain HTTP/1.1 connection reused after 6.5 s of idleness."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

import pytest

from tests.e2e.infra import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.postgres, pytest.mark.redis]


def test_an_idle_connection_outlives_a_pooled_clients_expiry(stack: Stack):
    address = urlsplit(stack.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    try:
        connection.request("GET", "/healthz")
        first = connection.getresponse()
        first.read()
        assert first.status == 200
        socket_before = connection.sock
        time.sleep(6.5)  # past httpx's 5 s pool expiry and uvicorn's 5 s default
        connection.request("GET", "/healthz")  # on the same socket: http.client only reconnects if it has none
        second = connection.getresponse()  # RemoteDisconnected if the server closed the idle connection
        second.read()
        assert second.status == 200
        assert connection.sock is socket_before
    finally:
        connection.close()
