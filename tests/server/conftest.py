"""Fixtures for the control-plane tests.

Each backend gets one database per test session, created and migrated with Alembic (the only schema
path), and dropped afterwards: a SQLite file, and a fresh database on the local PostgreSQL
(`--postgres-url`, default postgresql://postgres@127.0.0.1:5432/postgres; skipped when unreachable).
`app`/`client` are parametrized over both backends; every test starts from empty tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session

from server.app import create_app
from server.db import Database, upgrade_to_head
from server.models import utcnow
from server.services import tokens as token_service
from server.settings import Settings
from tests.conftest import DEFAULT_PG_ADMIN_URL  # noqa: F401 - re-exported for tests/web

# Emptied before every test; api_tokens is kept, so the tokens fixture is made once per backend.
TABLES = ["step_metrics", "step_metric_rollups", "step_metric_series", "run_events", "run_hosts", "hosts", "runs",
          "placement_decisions"]


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'locojax.db'}"
    upgrade_to_head(url)
    return url


def make_settings(tmp: Path, database_url: str, **overrides: Any) -> Settings:
    (tmp / "data").mkdir(exist_ok=True)
    values: dict[str, Any] = dict(
        home=tmp / "home", database_url=database_url, broker_url="memory://", migrate_on_start=False,
        data_roots=[tmp / "data"], runs_root=tmp / "runs", sse_poll_s=0.02, sse_max_s=1.5, readyz_timeout_s=1.0,
        page_size_max=20, page_size_default=10, scheduler_enabled=False,
    )
    values.update(overrides)
    return Settings(**values)


@dataclass
class Backend:
    name: str
    app: FastAPI
    client: TestClient
    db: Database
    settings: Settings
    tokens: "Tokens | None" = None


_backends: dict[str, Backend] = {}


@pytest.fixture(scope="session")
def backend_factory(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
                    ) -> Iterator[Callable[[str], Backend]]:
    def get(name: str) -> Backend:
        if name not in _backends:
            url = request.getfixturevalue("sqlite_url" if name == "sqlite" else "postgres_url")
            settings = make_settings(tmp_path_factory.mktemp(name), url)
            app = create_app(settings, plugins=False)
            client = TestClient(app)
            client.__enter__()
            _backends[name] = Backend(name, app, client, app.state.db, settings)
        return _backends[name]

    yield get
    for backend in _backends.values():
        backend.client.__exit__(None, None, None)
    _backends.clear()


def _empty_tables(db: Database) -> None:
    # DELETE, not TRUNCATE: on PostgreSQL a TRUNCATE creates new files for every table and index
    # (~0.5 s per test here), while deleting a test's few rows is instant.
    with db.engine.begin() as connection:
        for table in TABLES:
            connection.execute(text(f"DELETE FROM {table}"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest, backend_factory: Callable[[str], Backend]) -> Backend:
    backend = backend_factory(request.param)
    _empty_tables(backend.db)
    return backend


@pytest.fixture
def client(backend: Backend) -> TestClient:
    return backend.client


@pytest.fixture
def db(backend: Backend) -> Database:
    return backend.db


@pytest.fixture
def session(db: Database) -> Iterator[Session]:
    with db.write_session() as session:
        yield session


@dataclass
class Tokens:
    admin: str
    submit: str
    worker: str
    revoked: str
    expired: str

    def headers(self, scope: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {getattr(self, scope)}"}


@pytest.fixture
def tokens(backend: Backend) -> Tokens:
    if backend.tokens is None:
        backend.tokens = _make_tokens(backend.db)
    return backend.tokens


def _make_tokens(db: Database) -> Tokens:
    with db.write_session() as session:
        # The worker token acts as hosts named h* (h0, h1, host-a, ...); test_isolation makes its own.
        secrets_by_name = {
            scope: token_service.create(session, name=f"test-{scope}", scopes=[scope],
                                        hosts="h*" if scope == "worker" else None)[1]
            for scope in ("admin", "submit", "worker")
        }
        revoked, secret = token_service.create(session, name="test-revoked", scopes=["admin"])
        token_service.revoke(session, revoked.id)
        secrets_by_name["revoked"] = secret
        expired, secret = token_service.create(session, name="test-expired", scopes=["admin"])
        expired.expires_at = utcnow() - timedelta(seconds=1)
        session.commit()
        secrets_by_name["expired"] = secret
    return Tokens(**secrets_by_name)


@pytest.fixture
def admin(tokens: Tokens) -> dict[str, str]:
    return tokens.headers("admin")


@pytest.fixture
def worker(tokens: Tokens) -> dict[str, str]:
    return tokens.headers("worker")


@pytest.fixture
def submitter(tokens: Tokens) -> dict[str, str]:
    return tokens.headers("submit")
