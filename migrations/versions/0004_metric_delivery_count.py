"""Count every metric value the API receives per series (step_metric_series.values_posted), so that a
duplicate delivery, which the step_metrics primary key collapses, stays visible.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("step_metric_series") as batch:
        batch.add_column(sa.Column("values_posted", sa.BigInteger(), nullable=False, server_default="0"))
    # Series ingested before this revision: their posts were not counted; the rows stored are a floor.
    op.execute("""
        UPDATE step_metric_series SET values_posted = (
            SELECT count(*) FROM step_metrics m
            WHERE m.run_id = step_metric_series.run_id AND m.key = step_metric_series.key
              AND m.host = step_metric_series.host)
    """)


def downgrade() -> None:
    with op.batch_alter_table("step_metric_series") as batch:
        batch.drop_column("values_posted")
