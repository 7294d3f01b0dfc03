"""Settings from the environment, and Alembic as the one schema path (models and migrations agree)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from server.db import alembic_config, make_engine, upgrade_to_head
from server.models import Base
from server.settings import Settings


def test_embedded_defaults_need_no_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("LOCOJAX_"):
            monkeypatch.delenv(name)
    settings = Settings()
    assert settings.database_url == "sqlite:///.locojax/locojax.db"
    assert settings.broker_url == "sqla+sqlite:///.locojax/broker.db"
    assert settings.migrate_on_start is True and settings.is_sqlite
    # A dedicated data directory, never the working directory; both made absolute (issue 17).
    assert settings.data_roots == [Path.cwd() / ".locojax" / "data"] and settings.runs_root == Path.cwd() / "runs"


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("LOCOJAX_DATABASE_URL", "postgresql://postgres@db/locojax")
    monkeypatch.setenv("LOCOJAX_BROKER_URL", "redis://redis:6379/0")
    monkeypatch.setenv("LOCOJAX_DATA_ROOTS", os.pathsep.join(["/data", "/mnt/datasets"]))
    monkeypatch.setenv("LOCOJAX_PAGE_SIZE_MAX", "500")
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://postgres@db/locojax"
    assert settings.migrate_on_start is False  # production runs the migrate service instead
    assert settings.data_roots == [Path("/data"), Path("/mnt/datasets")]
    assert settings.page_size_max == 500 and settings.broker_url == "redis://redis:6379/0"


def test_as_environment_passes_real_secrets_and_round_trips(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("LOCOJAX_"):
            monkeypatch.delenv(name)
    settings = Settings(home=tmp_path, dashboard_secret="not-a-public-constant",
                        reward_modules=["mycompany.rewards", "tests.locojax"], data_roots=[tmp_path, Path("/data")])
    env = settings.as_environment(LOCOJAX_URL="http://127.0.0.1:1")
    assert env["LOCOJAX_DASHBOARD_SECRET"] == "not-a-public-constant"
    # What a child process (`locojax up` starts the API this way) reads back is the same configuration.
    for name, value in env.items():
        if name.startswith("LOCOJAX_"):
            monkeypatch.setenv(name, value)
    child = Settings()
    assert child.dashboard_secret is not None and child.dashboard_secret.get_secret_value() == "not-a-public-constant"
    assert child.reward_modules == ["mycompany.rewards", "tests.locojax"]
    assert child.data_roots == [tmp_path, Path("/data")]


def test_reward_modules_come_from_a_comma_separated_variable(monkeypatch):
    monkeypatch.setenv("LOCOJAX_REWARD_MODULES", "mycompany.rewards, tests.locojax")
    assert Settings().reward_modules == ["mycompany.rewards", "tests.locojax"]
    monkeypatch.delenv("LOCOJAX_REWARD_MODULES")
    assert Settings().reward_modules == []


def test_inconsistent_settings_are_refused():
    with pytest.raises(ValueError, match="host_lost_s"):
        Settings(host_stale_s=30, host_lost_s=10)


def test_only_settings_reads_the_environment():
    root = Path(__file__).resolve().parents[2]
    offenders = [str(path.relative_to(root)) for package in ("server", "migrations")
                 for path in (root / package).rglob("*.py")
                 if path.name != "settings.py" and ("os.environ" in path.read_text() or "getenv" in path.read_text())]
    assert offenders == []
    client = (root / "locojax" / "client.py").read_text()
    assert "os.environ" not in client and "getenv" not in client and "import server" not in client


@pytest.mark.parametrize("backend_url", ["sqlite_url", pytest.param("postgres_url", marks=pytest.mark.postgres)])
def test_migrations_match_the_models(request, backend_url):
    engine = make_engine(request.getfixturevalue(backend_url))
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_downgrade_and_upgrade_round_trip(tmp_path):
    url = f"sqlite:///{tmp_path / 'roundtrip.db'}"
    upgrade_to_head(url)
    config = alembic_config(url)
    command.downgrade(config, "base")
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    engine.dispose()
    upgrade_to_head(url)
    engine = make_engine(url)
    assert {"runs", "step_metrics", "api_tokens"} <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_app_start_migrates_an_embedded_database(tmp_path):
    from fastapi.testclient import TestClient

    from server.app import create_app

    settings = Settings(home=tmp_path / ".locojax", broker_url="memory://")
    assert settings.migrate_on_start
    with TestClient(create_app(settings, plugins=False)) as client:
        assert client.get("/readyz").status_code == 200
        assert client.get("/api/v1/runs").status_code == 401  # tables exist; auth is on from the start
    assert (tmp_path / ".locojax" / "locojax.db").exists()


def test_rollup_migration_backfills_what_ingest_would_have_built(tmp_path):
    import random

    from sqlalchemy import text

    from server.services.metrics import _update_series, refresh_rollups

    url = f"sqlite:///{tmp_path / 'backfill.db'}"
    command.upgrade(alembic_config(url), "0001")  # a database from before rollups existed
    rng = random.Random(3)
    rows = [{"run_id": 1, "key": key, "host": host, "step": step, "value": rng.uniform(-1, 1)}
            for key in ("a", "b/c") for host in (-1, 0) for step in range(0, 3000, rng.choice([1, 7]))]
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO runs (id, name, spec, spec_digest, status, mode, hosts_needed, restarts, "
                                "max_restarts, attempt, cancel_requested, created_at, updated_at) VALUES (1, 'r', '{}', "
                                "'x', 'RUNNING', 'co', 1, 0, 0, 0, 0, '2026-01-01', '2026-01-01')"))
        connection.execute(text("INSERT INTO step_metrics VALUES (:run_id, :key, :host, :step, :value)"), rows)
    upgrade_to_head(url)
    queries = [text("SELECT key, host, level, bucket, first_step, low, high, last_step, last_value "
                    "FROM step_metric_rollups ORDER BY key, host, level, bucket"),
               text("SELECT key, host, first_step, last_step, last_value FROM step_metric_series ORDER BY key, host")]
    with engine.begin() as connection:
        backfilled = [connection.execute(query).all() for query in queries]
        connection.execute(text("DELETE FROM step_metric_rollups"))
        connection.execute(text("DELETE FROM step_metric_series"))
    from sqlalchemy.orm import Session

    with Session(engine) as session:
        written = {(row["key"], row["host"], row["step"]): row["value"] for row in rows}
        refresh_rollups(session, 1, written)
        _update_series(session, 1, written)
        session.commit()
        rebuilt = [session.execute(query).all() for query in queries]
    engine.dispose()
    assert backfilled == rebuilt and len(rebuilt[0]) > 100 and len(rebuilt[1]) == 4
