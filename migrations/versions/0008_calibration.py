"""The placement model learns from finished runs (issue 41).

* `calibrations`: versions of each hardware profile's refitted constants (one active per hardware).
* `calibration_observations`: measured runs (finished here, or imported from run directories) that the
  calibrations are fitted on, with what the model predicted for each before it joined.
* `runs.hardware`, `runs.predicted`, `runs.calibration_id`: the reserved hosts' hardware profile and
  the prediction made for the run there; `placement_decisions.calibration_id`: the calibration a
  recommendation priced its options with.
* `hosts.device_memory_bytes`: what a worker found its devices hold.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
JSON_DOC = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hardware", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=True),
        sa.Column("observation_ids", JSON_DOC, nullable=False),
        sa.Column("constants", JSON_DOC, nullable=False),
        sa.Column("fit_error", JSON_DOC, nullable=False),
        sa.Column("profile", JSON_DOC, nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("activated_at", TS, nullable=True),
        sa.Column("activated_by", sa.String(128), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_calibrations"),
        sa.UniqueConstraint("hardware", "version", name="uq_calibrations_hardware_version"),
    )
    op.create_index("uq_calibrations_active_hardware", "calibrations", ["hardware"], unique=True,
                    sqlite_where=sa.text("active"), postgresql_where=sa.text("active"))
    op.create_table(
        "calibration_observations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hardware", sa.String(64), nullable=False),
        sa.Column("device_kind", sa.String(64), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("digest", sa.String(64), nullable=True),
        sa.Column("label", sa.String(255), nullable=False),
        sa.Column("finished", sa.Boolean(), nullable=False),
        sa.Column("spec", JSON_DOC, nullable=False),
        sa.Column("model", JSON_DOC, nullable=False),
        sa.Column("measured", JSON_DOC, nullable=False),
        sa.Column("predicted", JSON_DOC, nullable=True),
        sa.Column("calibration_id", sa.Integer(), nullable=True),
        sa.Column("measured_at", TS, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("excluded_at", TS, nullable=True),
        sa.Column("excluded_by", sa.String(128), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_calibration_observations_run_id_runs",
                                ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["calibration_id"], ["calibrations.id"],
                                name="fk_calibration_observations_calibration_id_calibrations", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_calibration_observations"),
        sa.UniqueConstraint("run_id", name="uq_calibration_observations_run_id"),
        sa.UniqueConstraint("digest", name="uq_calibration_observations_digest"),
    )
    op.create_index("ix_calibration_observations_hardware", "calibration_observations", ["hardware"])
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("hardware", sa.String(64), nullable=True))
        batch.add_column(sa.Column("predicted", JSON_DOC, nullable=True))
        batch.add_column(sa.Column("calibration_id", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_runs_calibration_id_calibrations", "calibrations", ["calibration_id"], ["id"],
                                 ondelete="SET NULL")
    with op.batch_alter_table("placement_decisions") as batch:
        batch.add_column(sa.Column("calibration_id", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_placement_decisions_calibration_id_calibrations", "calibrations",
                                 ["calibration_id"], ["id"], ondelete="SET NULL")
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("device_memory_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("device_memory_bytes")
    with op.batch_alter_table("placement_decisions") as batch:
        batch.drop_constraint("fk_placement_decisions_calibration_id_calibrations", type_="foreignkey")
        batch.drop_column("calibration_id")
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint("fk_runs_calibration_id_calibrations", type_="foreignkey")
        batch.drop_column("calibration_id")
        batch.drop_column("predicted")
        batch.drop_column("hardware")
    op.drop_index("ix_calibration_observations_hardware", table_name="calibration_observations")
    op.drop_table("calibration_observations")
    op.drop_index("uq_calibrations_active_hardware", table_name="calibrations")
    op.drop_table("calibrations")
