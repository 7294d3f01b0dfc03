"""Isolation between runs, tenants and hosts (issue 17).

* `runs.owner_token_id`: the token that submitted a run; only it (or an admin) may cancel, resume or
  delete the run. Idempotency keys become unique per owner, so one token's key never finds (or
  blocks) another token's run.
* `api_tokens.hosts`: what a worker token may act as: one host name, or a name prefix ending in `*`.
* `runs.queued_since`: when the run last entered QUEUED; the scheduler's bounded backfill wait
  counts from it.
* `hosts.start_failures`, `hosts.not_before`: a host that let start messages go unanswered until the
  start timeout (a fake or broken worker) is skipped by the scheduler for a doubling backoff, so it
  cannot keep attracting runs; a process it takes up clears both.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("hosts", sa.String(128), nullable=True))
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("start_failures", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner_token_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("queued_since", sa.DateTime(timezone=True), nullable=True))
        batch.create_foreign_key("fk_runs_owner_token_id_api_tokens", "api_tokens", ["owner_token_id"], ["id"],
                                 ondelete="SET NULL")
        batch.drop_constraint("uq_runs_idempotency_key", type_="unique")
        batch.create_unique_constraint("uq_runs_owner_token_id_idempotency_key", ["owner_token_id", "idempotency_key"])


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint("uq_runs_owner_token_id_idempotency_key", type_="unique")
        batch.create_unique_constraint("uq_runs_idempotency_key", ["idempotency_key"])
        batch.drop_constraint("fk_runs_owner_token_id_api_tokens", type_="foreignkey")
        batch.drop_column("queued_since")
        batch.drop_column("owner_token_id")
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("not_before")
        batch.drop_column("start_failures")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("hosts")
