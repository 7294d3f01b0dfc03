"""Rollups of step metrics (min / max / last per aligned bucket of 4, 32 and 256 steps) and a per-series
summary (step range, latest value), for fast history and latest-value queries.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

Existing runs' rollups and series rows are built from their raw rows here, so queries stay exact after
the upgrade.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEVELS = (4, 32, 256)


def upgrade() -> None:
    op.create_table(
        "step_metric_rollups",
        sa.Column("run_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("host", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("level", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("bucket", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("first_step", sa.Integer(), nullable=False),
        sa.Column("low", sa.Double(), nullable=False),
        sa.Column("high", sa.Double(), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=False),
        sa.Column("last_value", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "key", "host", "level", "bucket", name="pk_step_metric_rollups"),
        # Rewritten by every batch: room in each page lets PostgreSQL update rows in place (HOT).
        postgresql_with={"fillfactor": 50},
    )
    op.create_table(
        "step_metric_series",
        sa.Column("run_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("host", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("first_step", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=False),
        sa.Column("last_value", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "key", "host", name="pk_step_metric_series"),
        postgresql_with={"fillfactor": 50},
    )
    op.execute("""
        INSERT INTO step_metric_series (run_id, key, host, first_step, last_step, last_value)
        SELECT g.run_id, g.key, g.host, g.first_step, g.last_step, m.value
        FROM (SELECT run_id, key, host, min(step) AS first_step, max(step) AS last_step
              FROM step_metrics GROUP BY run_id, key, host) g
        JOIN step_metrics m ON m.run_id = g.run_id AND m.key = g.key AND m.host = g.host AND m.step = g.last_step
    """)
    source, source_step, source_level = "step_metrics", "step", None
    for level in LEVELS:
        # Each level from the one below: raw rows for the first, then whole buckets of the previous level.
        divisor = level if source_level is None else level // source_level
        group = f"{source_step} / {level}" if source_level is None else f"bucket / {divisor}"
        value, first_step, low, high, last_step = ("value", "step", "value", "value", "step") \
            if source_level is None else ("last_value", "first_step", "low", "high", "last_step")
        level_filter = "" if source_level is None else f"AND s.level = {source_level}"
        op.execute(f"""
            INSERT INTO step_metric_rollups (run_id, key, host, level, bucket, first_step, low, high, last_step,
                                             last_value)
            SELECT g.run_id, g.key, g.host, {level}, g.bucket, g.first_step, g.low, g.high, g.last_step, s.{value}
            FROM (SELECT run_id, key, host, {group} AS bucket, min({first_step}) AS first_step, min({low}) AS low,
                         max({high}) AS high, max({last_step}) AS last_step
                  FROM {source} s WHERE 1 = 1 {level_filter}
                  GROUP BY run_id, key, host, {group}) g
            JOIN {source} s ON s.run_id = g.run_id AND s.key = g.key AND s.host = g.host
                 AND s.{last_step} = g.last_step {level_filter}
        """)
        source, source_level = "step_metric_rollups", level


def downgrade() -> None:
    op.drop_table("step_metric_rollups")
    op.drop_table("step_metric_series")
