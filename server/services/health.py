"""Readiness: is the database answering, and can a Celery worker reach the broker?"""

from __future__ import annotations

from server.db import Database


def check_database(db: Database) -> str:
    try:
        db.ping()
        return "ok"
    except Exception as exc:  # any driver error means "not ready"; the message says which
        return f"error: {type(exc).__name__}"


def check_broker(url: str, timeout_s: float) -> str:
    from kombu import Connection

    try:
        # No transport_options: the SQLAlchemy transport would pass them all to create_engine.
        with Connection(url, connect_timeout=timeout_s) as connection:
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=timeout_s)
        return "ok"
    except Exception as exc:
        return f"error: {type(exc).__name__}"
