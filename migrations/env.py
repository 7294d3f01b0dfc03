"""Alembic environment: runs migrations against the URL the caller set, or the one in Settings.

`server.db.upgrade_to_head` passes the URL explicitly (embedded start-up, tests); the `alembic` command
line falls back to `LOCOJAX_DATABASE_URL` through `server.settings`, the one module that reads the env.
"""

from __future__ import annotations

import logging.config

from alembic import context

from server.db import make_engine
from server.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _database_url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from server.settings import get_settings

    return get_settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_database_url())
    try:
        with engine.connect() as connection:
            # Batch mode lets later migrations ALTER tables on SQLite (copy-and-move).
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                              compare_type=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
