"""ORM models: the control plane's tables (DESIGN §7). The database is the source of truth.

SQLAlchemy 2.x typed mappings; the schema itself changes only through Alembic (`migrations/`), and a test
checks that the migrations and these models agree. Types are chosen to mean the same on PostgreSQL
and SQLite: enums are VARCHAR + CHECK (no native PG enums to migrate), JSON is JSONB on PostgreSQL,
timestamps are always timezone-aware UTC when read back.
"""

from __future__ import annotations

import enum
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Double,
    Enum,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from locojax import contract


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is UTC-aware on the way in and out; SQLite stores naive text otherwise."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTCDateTime column")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


# SQLite only auto-increments an INTEGER PRIMARY KEY, so big ids fall back to INTEGER there.
BigId = BigInteger().with_variant(Integer(), "sqlite")
JsonDoc = JSON().with_variant(JSONB(), "postgresql")


# The run statuses are the contract's; the control plane stores them (re-exported for its modules).
RunStatus = contract.RunStatus
TERMINAL_STATES = contract.TERMINAL_STATES


class HostRole(str, enum.Enum):
    CO = "co"  # colocated: rollout + reward + train on every host
    ROLLOUT = "rollout"  # DA rollout group
    TRAIN = "train"  # DA train group
    CONTROLLER = "controller"  # SC controller, or the DA driver
    WORKER = "worker"  # SC: one per reserved host, samples and trains its host's share as the controller says


HostProcessStatus = contract.HostProcessStatus  # what a worker reports about its engine process


ENDED_PROCESS_STATES = frozenset({HostProcessStatus.EXITED, HostProcessStatus.FAILED, HostProcessStatus.KILLED,
                                  HostProcessStatus.LOST})


class HostRecordStatus(str, enum.Enum):
    """What the database stores; the API derives ONLINE/STALE/LOST from heartbeat age on top."""

    ONLINE = "ONLINE"
    LOST = "LOST"  # set by the reconciler; the next heartbeat brings the host back


def _str_enum(enum_cls: type[enum.Enum], length: int) -> Enum:
    return Enum(enum_cls, native_enum=False, create_constraint=True, length=length, validate_strings=True,
                values_callable=lambda members: [m.value for m in members], name=enum_cls.__name__.lower())


class Base(DeclarativeBase):
    # Stable constraint names so Alembic can alter and drop them on both backends.
    metadata = MetaData(naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    })
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JsonDoc}


class PlacementDecision(Base):
    """One call of the recommender: its inputs, every option it priced, its choice and why.

    `measured_step_s` is written back when a run that follows this decision finishes (the median of its
    aggregated `time/step`), so predicted and measured step time sit side by side.
    """

    __tablename__ = "placement_decisions"

    id: Mapped[int] = mapped_column(primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(128))
    request: Mapped[dict[str, Any]]
    options: Mapped[list[dict[str, Any]]] = mapped_column(JsonDoc)
    choice: Mapped[dict[str, Any]]
    reason: Mapped[str] = mapped_column(Text)
    mode: Mapped[str] = mapped_column(String(8))
    predicted_step_s: Mapped[float] = mapped_column(Double)
    measured_step_s: Mapped[float | None] = mapped_column(Double)
    measured_at: Mapped[datetime | None]
    measured_run_id: Mapped[int | None] = mapped_column(Integer)  # no FK: runs point here, not back
    # The hardware calibration its options were priced with (None: the catalog's shipped constants).
    calibration_id: Mapped[int | None] = mapped_column(ForeignKey("calibrations.id", ondelete="SET NULL"))


class Calibration(Base):
    """One version of a hardware profile's constants, refitted from its observations
    (`locojax.placement.calibration.calibrate`): when, from which observations, the fitted constants,
    the whole profile they make, and the fit error before and after. Exactly one version per hardware
    is active (what recommendations and run predictions use); an admin may make an earlier one active
    again. Versions count up per hardware and are never rewritten."""

    __tablename__ = "calibrations"
    __table_args__ = (UniqueConstraint("hardware", "version"),
                      Index("uq_calibrations_active_hardware", "hardware", unique=True,
                            sqlite_where=text("active"), postgresql_where=text("active")))

    id: Mapped[int] = mapped_column(primary_key=True)
    hardware: Mapped[str] = mapped_column(String(64))
    version: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(128))
    observation_ids: Mapped[list[int]] = mapped_column(JsonDoc)
    constants: Mapped[dict[str, Any]]
    fit_error: Mapped[dict[str, Any]]  # {"before": FitError, "after": FitError}
    profile: Mapped[dict[str, Any]]  # HardwareProfile.to_json() of the fitted profile
    active: Mapped[bool] = mapped_column(Boolean, default=False)
    activated_at: Mapped[datetime | None]
    activated_by: Mapped[str | None] = mapped_column(String(128))


class Run(Base):
    __tablename__ = "runs"
    # Idempotency keys are scoped to the token that used them: another token's key is another request.
    __table_args__ = (Index(None, "status", "id"), UniqueConstraint("owner_token_id", "idempotency_key"))

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    spec: Mapped[dict[str, Any]]  # the normalised RunSpec (model_dump(mode="json"))
    spec_digest: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[RunStatus] = mapped_column(_str_enum(RunStatus, 16))
    status_reason: Mapped[str | None] = mapped_column(Text)
    mode: Mapped[str] = mapped_column(String(8))
    hosts_needed: Mapped[int]
    # `restarts` counts automatic recoveries of this attempt (compared with max_restarts); `attempt`
    # counts host-group launches overall (recoveries and user resumes), tagging run_hosts rows.
    restarts: Mapped[int] = mapped_column(default=0)
    max_restarts: Mapped[int]
    attempt: Mapped[int] = mapped_column(default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    decision_id: Mapped[int | None] = mapped_column(
        ForeignKey("placement_decisions.id", ondelete="SET NULL"), index=True)
    created_by: Mapped[str | None] = mapped_column(String(128))
    # Who may cancel, resume or delete the run (besides admins); token names are not unique, ids are.
    owner_token_id: Mapped[int | None] = mapped_column(ForeignKey("api_tokens.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    # When the run last entered QUEUED (submit, requeue, resume): the backfill wait counts from here.
    queued_since: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    last_checkpoint_step: Mapped[int | None]
    measured_step_s: Mapped[float | None] = mapped_column(Double)
    # The catalog profile of the hosts reserved for it, and what the placement model predicted for it
    # there when they were (step, phases and split; `calibration_id`: the calibration it used).
    hardware: Mapped[str | None] = mapped_column(String(64))
    predicted: Mapped[dict[str, Any] | None]
    calibration_id: Mapped[int | None] = mapped_column(ForeignKey("calibrations.id", ondelete="SET NULL"))
    # Scheduler bookkeeping: when the current attempt's host group was sent out; a run requeued after a
    # failed start is not tried again before `not_before` (exponential backoff on `dispatch_failures`).
    dispatched_at: Mapped[datetime | None]
    # The current attempt's shared secret (StartHostMessage.secret); not part of any API response.
    attempt_secret: Mapped[str | None] = mapped_column(String(64), nullable=True)
    not_before: Mapped[datetime | None]
    dispatch_failures: Mapped[int] = mapped_column(default=0, server_default="0")


class RunHost(Base):
    """One engine host process of one attempt of a run (a run of N hosts has N rows per attempt)."""

    __tablename__ = "run_hosts"
    __table_args__ = (UniqueConstraint("run_id", "attempt", "process_index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(default=0)
    process_index: Mapped[int]
    host_name: Mapped[str] = mapped_column(String(128))
    role: Mapped[HostRole] = mapped_column(_str_enum(HostRole, 16))
    pid: Mapped[int | None]
    status: Mapped[HostProcessStatus] = mapped_column(_str_enum(HostProcessStatus, 16))
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    exit_code: Mapped[int | None]
    # Process 0 of a multi-host attempt publishes its JAX coordinator ADDR:PORT here; its peers wait for it.
    address: Mapped[str | None] = mapped_column(String(255))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    @property
    def ended(self) -> bool:
        return self.status in ENDED_PROCESS_STATES


class Host(Base):
    """Inventory: one machine (or simulated host) that runs a Celery worker consuming `host.<name>`."""

    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    slice: Mapped[str | None] = mapped_column(String(128))
    device_kind: Mapped[str] = mapped_column(String(64))  # a hardware catalog name (tpu-v5e, local-cpu, ...)
    device_count: Mapped[int]
    device_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)  # one device's, as JAX reports it
    status: Mapped[HostRecordStatus] = mapped_column(_str_enum(HostRecordStatus, 16))
    reserved_by_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), index=True)
    info: Mapped[dict[str, Any]] = mapped_column(default=dict)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(default=utcnow)
    # A host whose start messages went unanswered until the start timeout (a fake or broken worker: it
    # heartbeats but takes no work) is not reserved before `not_before` (doubling per failure), so it
    # cannot keep attracting runs; taking up a process clears both.
    start_failures: Mapped[int] = mapped_column(default=0, server_default="0")
    not_before: Mapped[datetime | None]


# Aggregated rows (over all hosts of a step) use this host value; 0..N-1 are process indices (the
# contract's convention, which the worker's metrics relay writes too).
AGGREGATE_HOST = contract.AGGREGATE_HOST_INDEX


class StepMetric(Base):
    """One scalar of one step of one host. Ingest is an idempotent upsert on the primary key.

    Primary key order (run_id, key, host, step): every history query fixes run, key and host and scans a
    step range, so host comes before step; the same index serves "all hosts of a key" by its prefix.

    No foreign key to runs, on purpose (here and in the rollup and series tables): PostgreSQL checks a
    foreign key with one lookup per inserted row, which cost more than the insert itself. Ingest takes
    one key-share lock on the run row instead (what those checks amount to), and deleting a run deletes
    its metrics explicitly.
    """

    __tablename__ = "step_metrics"

    run_id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    value: Mapped[float] = mapped_column(Double)


# Step-bucket sizes of the rollup levels, each built from the one below (4 raw steps, 8 level-4 buckets,
# 8 level-32 buckets). A query for N points reads fewer than 8N rows of the level it uses (4N raw rows
# below the first level); three levels cost ingest about a third more time than none.
ROLLUP_LEVELS = (4, 32, 256)


class StepMetricRollup(Base):
    """first step, min, max and last value of one series over one aligned bucket of `level` steps, kept
    current by ingest.

    History queries that downsample by at least `level` steps per point read these instead of the raw
    rows; the answer is identical because buckets are aligned to multiples of the level and every
    output bucket is a whole number of rollup buckets.
    """

    __tablename__ = "step_metric_rollups"
    # Every batch rewrites its series' open buckets; free space in each page lets PostgreSQL update them
    # in place (HOT) instead of adding index entries for every new row version.
    __table_args__ = {"postgresql_with": {"fillfactor": 50}}

    run_id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    level: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    bucket: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)  # step // level
    first_step: Mapped[int]
    low: Mapped[float] = mapped_column(Double)
    high: Mapped[float] = mapped_column(Double)
    last_step: Mapped[int]
    last_value: Mapped[float] = mapped_column(Double)


class StepMetricSeries(Base):
    """One row per (run, key, host): its step range, latest value and delivery count, kept current by ingest.

    Answers "which series exist", "latest value of every key" and "step range of a series" without
    touching the raw rows.
    """

    __tablename__ = "step_metric_series"
    __table_args__ = {"postgresql_with": {"fillfactor": 50}}  # updated by every batch (see rollups)

    run_id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    key: Mapped[str] = mapped_column(String(200), primary_key=True)
    host: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    first_step: Mapped[int]
    last_step: Mapped[int]
    last_value: Mapped[float] = mapped_column(Double)
    # Values of this series the API received, every post counted: retried batches, re-posted steps and
    # repeats inside one batch included. The primary key of step_metrics collapses those, so this is
    # the only place where a duplicate delivery is visible (values_posted - rows stored).
    values_posted: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class CalibrationObservation(Base):
    """One measured run that teaches the placement model: what ran (its spec and the model dimensions it
    trained), on which hardware, and its median per-phase step times after warm-up
    (`locojax.placement.calibration.StepMeasurement`). From a run of this control plane (`run_id`, added
    when it finishes) or imported from a run directory measured elsewhere (`digest`, which makes the
    import idempotent). `predicted` is what the model said before this observation joined it (and
    `calibration_id` the calibration that said it): the error the placement page charts. An
    admin may exclude one from the fits (`excluded_at`); `updated_at` moves with every change, which is
    how a hardware's active calibration knows it is out of date."""

    __tablename__ = "calibration_observations"

    id: Mapped[int] = mapped_column(primary_key=True)
    hardware: Mapped[str] = mapped_column(String(64), index=True)
    device_kind: Mapped[str] = mapped_column(String(64))
    device_count: Mapped[int]
    source: Mapped[str] = mapped_column(String(16))  # "run" or "import"
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), unique=True)
    digest: Mapped[str | None] = mapped_column(String(64), unique=True)
    label: Mapped[str] = mapped_column(String(255))
    finished: Mapped[bool] = mapped_column(Boolean)
    spec: Mapped[dict[str, Any]]
    model: Mapped[dict[str, Any]]
    measured: Mapped[dict[str, Any]]
    predicted: Mapped[dict[str, Any] | None]
    calibration_id: Mapped[int | None] = mapped_column(ForeignKey("calibrations.id", ondelete="SET NULL"))
    measured_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(128))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    excluded_at: Mapped[datetime | None]
    excluded_by: Mapped[str | None] = mapped_column(String(128))


class RunEvent(Base):
    """A log line of a run. `seq` (optional, per source) makes retried appends idempotent."""

    __tablename__ = "run_events"
    __table_args__ = (Index(None, "run_id", "id"), UniqueConstraint("run_id", "source", "seq"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    ts: Mapped[datetime] = mapped_column(default=utcnow)
    level: Mapped[str] = mapped_column(String(8))
    source: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    seq: Mapped[int | None] = mapped_column(BigInteger)


class ApiToken(Base):
    """A bearer token. Only the SHA-256 of the secret is stored; `prefix` lets people tell tokens apart."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[str] = mapped_column(String(64))  # space-separated, as in OAuth
    # Worker tokens only: the host this token may act as, by exact name or by a `prefix*` pattern.
    hosts: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]

    @property
    def scope_set(self) -> frozenset[str]:
        return frozenset(self.scopes.split())


class WebSession(Base):
    """A dashboard login. The cookie carries a random session id; only its SHA-256 is stored. Logging
    out sets `revoked_at`, and a cookie whose row is revoked, expired or gone is refused at once."""

    __tablename__ = "web_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
