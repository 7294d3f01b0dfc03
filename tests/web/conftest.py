"""Fixtures for the dashboard tests.

Databases are made the way tests/server makes them (Alembic on a fresh SQLite file, a fresh database on
the local PostgreSQL), with the same `make_settings`. `site` is parametrized over both backends and
serves the whole app (API + dashboard plugin) in-process for TestClient tests; `live_server` runs it
under uvicorn on a free loopback port for the browser tests (PostgreSQL, as in production).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text

from server.app import create_app
from server.db import Database, upgrade_to_head
from server.services import tokens as token_service
from tests.conftest import create_postgres_database
from tests.server.conftest import DEFAULT_PG_ADMIN_URL, TABLES, make_settings

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CSRF_INPUT = re.compile(r'name="csrf_token" value="([^"]+)"')


def _create_postgres_database(admin_url: str) -> tuple[str, Callable[[], None]]:
    # A database of their own, so the web tests' tokens and runs stay apart from the server tests'.
    return create_postgres_database(admin_url, prefix="locojax_web")


def _admin_url(config: pytest.Config) -> str:
    # tests/server's conftest adds --postgres-url; when only tests/web is collected, the option is absent.
    return config.getoption("--postgres-url", default=DEFAULT_PG_ADMIN_URL) or DEFAULT_PG_ADMIN_URL


@pytest.fixture(scope="session")
def web_postgres_url(request: pytest.FixtureRequest) -> Iterator[str]:
    url, drop = _create_postgres_database(_admin_url(request.config))
    try:
        yield url
    finally:
        drop()


@pytest.fixture(scope="session")
def web_sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('web-sqlite') / 'locojax.db'}"
    upgrade_to_head(url)
    return url


def make_tokens(db: Database) -> dict[str, str]:
    with db.write_session() as session:
        return {scope: token_service.create(session, name=f"web-{scope}", scopes=[scope],
                                            hosts="browser-*" if scope == "worker" else None)[1]
                for scope in ("submit", "worker", "admin")}


def empty_tables(db: Database) -> None:
    with db.engine.begin() as connection:
        for table in TABLES:
            connection.execute(text(f"DELETE FROM {table}"))


@dataclass
class Site:
    name: str
    app: FastAPI
    db: Database
    tokens: dict[str, str]
    data_dir: Path

    def client(self) -> TestClient:
        """A fresh client (its own cookie jar) for each test; the app runs no lifespan work here."""
        return TestClient(self.app, follow_redirects=False)

    def bearer(self, scope: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[scope]}"}


_sites: dict[str, Site] = {}


@pytest.fixture(scope="session")
def site_factory(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
                 ) -> Iterator[Callable[[str], Site]]:
    def get(name: str) -> Site:
        if name not in _sites:
            url = request.getfixturevalue("web_sqlite_url" if name == "sqlite" else "web_postgres_url")
            tmp = tmp_path_factory.mktemp(f"web-{name}")
            settings = make_settings(tmp, url, page_size_default=3, page_size_max=20)
            app = create_app(settings)
            _sites[name] = Site(name, app, app.state.db, make_tokens(app.state.db), tmp / "data")
        return _sites[name]

    yield get
    for site in _sites.values():
        site.db.dispose()
    _sites.clear()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def site(request: pytest.FixtureRequest, site_factory: Callable[[str], Site]) -> Site:
    site = site_factory(request.param)
    empty_tables(site.db)
    return site


def csrf_from(html: str) -> str:
    match = CSRF_INPUT.search(html)
    assert match, "no CSRF field in the page"
    return match.group(1)


def login(client: TestClient, secret: str) -> str:
    """Log in through the form; returns the session's CSRF token."""
    page = client.get("/login")
    response = client.post("/login", data={"token": secret, "csrf_token": csrf_from(page.text), "next": "/runs"})
    assert response.status_code == 303, response.text
    return csrf_from(client.get("/runs").text)


@dataclass
class Browsing:
    """A TestClient logged in with a token of one scope, and its CSRF token."""

    client: TestClient
    csrf: str
    site: Site

    def post(self, url: str, data: dict[str, Any] | None = None, **kwargs: Any) -> httpx.Response:
        return self.client.post(url, data={"csrf_token": self.csrf, **(data or {})}, **kwargs)


@pytest.fixture
def submitter(site: Site) -> Browsing:
    client = site.client()
    return Browsing(client, login(client, site.tokens["submit"]), site)


@pytest.fixture
def reader(site: Site) -> Browsing:
    """Logged in with a worker token: may read everything, may change nothing from the dashboard."""
    client = site.client()
    return Browsing(client, login(client, site.tokens["worker"]), site)


# --- live server for the browser tests --------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    app: FastAPI
    tokens: dict[str, str]
    worker: httpx.Client = field(repr=False)  # an admin client: moves runs by hand, reports for any host
    submitter: httpx.Client = field(repr=False)


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    # A database of its own: the TestClient tests empty their tables between tests.
    url, drop = _create_postgres_database(_admin_url(request.config))
    tmp = tmp_path_factory.mktemp("web-live")
    # Fast polling keeps the waits short; the intervals are what production uses, only smaller.
    settings = make_settings(tmp, url, dashboard_poll_s=0.4, sse_poll_s=0.1, sse_max_s=30.0)
    app = create_app(settings)
    tokens = make_tokens(app.state.db)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the dashboard server did not start")
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    # No scheduler or workers here: the "worker" side is played by an admin token, the one that may move
    # runs by hand and report without a placed host process (issue 17).
    worker = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {tokens['admin']}"}, timeout=30)
    submitter = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {tokens['submit']}"}, timeout=30)
    try:
        yield LiveServer(base, app, tokens, worker, submitter)
    finally:
        worker.close()
        submitter.close()
        server.should_exit = True
        thread.join(timeout=10)
        app.state.db.dispose()
        drop()
