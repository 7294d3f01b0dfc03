"""Engines, sessions and migrations.

One engine per app. SQLite gets the pragmas that make it a usable embedded server (WAL so readers do
not block the writer, a busy timeout, foreign keys on) and `BEGIN IMMEDIATE` for sessions that write:
a deferred transaction that reads first and writes later fails at once with "database is locked" when
another writer committed in between, instead of waiting for the lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from server.settings import Settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def make_engine(database_url: str, **kwargs: Any) -> Engine:
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 20)
        return create_engine(url, **kwargs)

    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy (not the sqlite3 module) decide when transactions begin; see "begin" below.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(connection: Any) -> None:
        mode = "IMMEDIATE" if connection.get_execution_options().get("sqlite_write") else "DEFERRED"
        connection.exec_driver_sql(f"BEGIN {mode}")

    return engine


class Database:
    """The engine and two session factories: one for reads, one for units of work that write."""

    def __init__(self, settings: Settings, **engine_kwargs: Any):
        self.url = settings.database_url
        self.engine = make_engine(self.url, **engine_kwargs)
        self.read_session = sessionmaker(self.engine, expire_on_commit=False)
        self.write_session = sessionmaker(self.engine.execution_options(sqlite_write=True), expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def ping(self) -> None:
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()


def session_for(db: Database, write: bool) -> Session:
    return db.write_session() if write else db.read_session()


def alembic_config(database_url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Alembic's ini interpolation would treat a '%' in a password as syntax.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade_to_head(database_url: str) -> None:
    """`alembic upgrade head`: the only way the schema is created or changed."""
    from alembic import command

    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(database_url), "head")
