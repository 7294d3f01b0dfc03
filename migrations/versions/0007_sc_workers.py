"""SC across the hosts it reserves (issue 19).

* `run_hosts.role` gains `worker`: an SC run starts one controller and one worker per reserved host
  (each samples and trains its host's share as the controller says).
* `runs.attempt_secret`: the current attempt's shared secret, sent in each start message, with which
  an attempt's processes authenticate each other over the network.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROLES_BEFORE = ("co", "rollout", "train", "controller")
ROLES_AFTER = ROLES_BEFORE + ("worker",)


def _roles(values: Sequence[str]) -> str:
    return "role IN (" + ", ".join(f"'{value}'" for value in values) + ")"


def upgrade() -> None:
    with op.batch_alter_table("run_hosts") as batch:
        batch.drop_constraint("ck_run_hosts_hostrole", type_="check")
        batch.create_check_constraint("ck_run_hosts_hostrole", _roles(ROLES_AFTER))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("attempt_secret", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("attempt_secret")
    with op.batch_alter_table("run_hosts") as batch:
        batch.drop_constraint("ck_run_hosts_hostrole", type_="check")
        batch.create_check_constraint("ck_run_hosts_hostrole", _roles(ROLES_BEFORE))
