"""Dashboard sessions kept server-side, so that logging out ends a session at once (an old cookie is
refused) rather than when its signature expires.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "web_sessions",
        sa.Column("id_hash", sa.String(64), primary_key=True),
        sa.Column("token_id", sa.Integer(), sa.ForeignKey("api_tokens.id", ondelete="CASCADE"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_web_sessions_token_id", "web_sessions", ["token_id"])


def downgrade() -> None:
    op.drop_index("ix_web_sessions_token_id", table_name="web_sessions")
    op.drop_table("web_sessions")
