"""Dispatch bookkeeping for the gang scheduler: when a run's host group was last sent out, when a
requeued run may be tried again, and the coordinator address process 0 of an attempt publishes.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("dispatch_failures", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("run_hosts") as batch:
        batch.add_column(sa.Column("address", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("run_hosts") as batch:
        batch.drop_column("address")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("dispatch_failures")
        batch.drop_column("not_before")
        batch.drop_column("dispatched_at")
