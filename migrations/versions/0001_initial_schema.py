"""Initial schema: runs, run_hosts, hosts, step_metrics, run_events, placement_decisions, api_tokens.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Written to be self-contained (no imports from server.models): a migration is a frozen record of the
schema at one point, and must keep working when the models move on.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
JSON_DOC = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

RUN_STATUS = ("QUEUED", "STARTING", "RUNNING", "CANCELLING", "RECOVERING", "SUCCEEDED", "FAILED", "CANCELLED")
HOST_ROLE = ("co", "rollout", "train", "controller")
HOST_PROCESS_STATUS = ("STARTING", "RUNNING", "EXITED", "FAILED", "KILLED", "LOST")
HOST_RECORD_STATUS = ("ONLINE", "LOST")


def _one_of(column: str, values: Sequence[str], name: str) -> sa.CheckConstraint:
    listed = ", ".join(f"'{value}'" for value in values)
    return sa.CheckConstraint(f"{column} IN ({listed})", name=name)


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("scopes", sa.String(64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=True),
        sa.Column("revoked_at", TS, nullable=True),
        sa.Column("last_used_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_token_hash"),
    )
    op.create_table(
        "placement_decisions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=True),
        sa.Column("request", JSON_DOC, nullable=False),
        sa.Column("options", JSON_DOC, nullable=False),
        sa.Column("choice", JSON_DOC, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("mode", sa.String(8), nullable=False),
        sa.Column("predicted_step_s", sa.Double(), nullable=False),
        sa.Column("measured_step_s", sa.Double(), nullable=True),
        sa.Column("measured_at", TS, nullable=True),
        sa.Column("measured_run_id", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_placement_decisions"),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("spec", JSON_DOC, nullable=False),
        sa.Column("spec_digest", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("mode", sa.String(8), nullable=False),
        sa.Column("hosts_needed", sa.Integer(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("max_restarts", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("decision_id", sa.Integer(), nullable=True),
        sa.Column("created_by", sa.String(128), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("last_checkpoint_step", sa.Integer(), nullable=True),
        sa.Column("measured_step_s", sa.Double(), nullable=True),
        _one_of("status", RUN_STATUS, "ck_runs_runstatus"),
        sa.ForeignKeyConstraint(["decision_id"], ["placement_decisions.id"],
                                name="fk_runs_decision_id_placement_decisions", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.UniqueConstraint("idempotency_key", name="uq_runs_idempotency_key"),
    )
    op.create_index("ix_runs_decision_id", "runs", ["decision_id"])
    op.create_index("ix_runs_name", "runs", ["name"])
    op.create_index("ix_runs_spec_digest", "runs", ["spec_digest"])
    op.create_index("ix_runs_status_id", "runs", ["status", "id"])

    op.create_table(
        "hosts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("slice", sa.String(128), nullable=True),
        sa.Column("device_kind", sa.String(64), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reserved_by_run_id", sa.Integer(), nullable=True),
        sa.Column("info", JSON_DOC, nullable=False),
        sa.Column("registered_at", TS, nullable=False),
        sa.Column("last_heartbeat", TS, nullable=False),
        _one_of("status", HOST_RECORD_STATUS, "ck_hosts_hostrecordstatus"),
        sa.ForeignKeyConstraint(["reserved_by_run_id"], ["runs.id"], name="fk_hosts_reserved_by_run_id_runs",
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_hosts"),
        sa.UniqueConstraint("name", name="uq_hosts_name"),
    )
    op.create_index("ix_hosts_reserved_by_run_id", "hosts", ["reserved_by_run_id"])

    op.create_table(
        "run_events",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("ts", TS, nullable=False),
        sa.Column("level", sa.String(8), nullable=False),
        sa.Column("source", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_run_events_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_run_events"),
        sa.UniqueConstraint("run_id", "source", "seq", name="uq_run_events_run_id_source_seq"),
    )
    op.create_index("ix_run_events_run_id_id", "run_events", ["run_id", "id"])

    op.create_table(
        "run_hosts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("process_index", sa.Integer(), nullable=False),
        sa.Column("host_name", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("ended_at", TS, nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        _one_of("role", HOST_ROLE, "ck_run_hosts_hostrole"),
        _one_of("status", HOST_PROCESS_STATUS, "ck_run_hosts_hostprocessstatus"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_run_hosts_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_run_hosts"),
        sa.UniqueConstraint("run_id", "attempt", "process_index", name="uq_run_hosts_run_id_attempt_process_index"),
    )
    # (run_id, key, host, step): history queries fix run, key and host and scan a step range. No foreign
    # key: a per-row check costs more than the insert; ingest locks the run row once instead.
    op.create_table(
        "step_metrics",
        sa.Column("run_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("host", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("step", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "key", "host", "step", name="pk_step_metrics"),
    )


def downgrade() -> None:
    op.drop_table("step_metrics")
    op.drop_table("run_hosts")
    op.drop_index("ix_run_events_run_id_id", table_name="run_events")
    op.drop_table("run_events")
    op.drop_index("ix_hosts_reserved_by_run_id", table_name="hosts")
    op.drop_table("hosts")
    for index in ("ix_runs_status_id", "ix_runs_spec_digest", "ix_runs_name", "ix_runs_decision_id"):
        op.drop_index(index, table_name="runs")
    op.drop_table("runs")
    op.drop_table("placement_decisions")
    op.drop_table("api_tokens")
