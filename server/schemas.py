"""Pydantic schemas of the REST API, separate from the ORM models (STYLE habit 6).

Families per resource: `XCreate` (request body), `XPublic` (one resource out), `XsPublic` (a page of them,
`{"data": [...], "next_cursor": ...}`). Every request model forbids unknown fields, so a typo is a 422
naming the field instead of a silently ignored value.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema, field_validator

from locojax.spec import RunSpec
from server.models import AGGREGATE_HOST, HostProcessStatus, HostRole, RunStatus


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


# Every worker report names the run attempt it belongs to; one of an older attempt is a 409 (issue 17).
Attempt = Annotated[int, Field(ge=0, le=2**31 - 1, description="the run attempt this report belongs to; "
                                                               "a stale one is refused (409 STALE_ATTEMPT)")]
ReporterHost = Annotated[str | None, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                           description="the host reporting (a worker token bound to a prefix "
                                                       "says which of its hosts it is)")]


# --- errors -----------------------------------------------------------------------------------------

class ErrorBody(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. RUN_NOT_FOUND")
    message: str
    details: Any = Field(None, description="for validation errors: a list of {field, message}")


class ErrorResponse(BaseModel):
    error: ErrorBody


# --- runs -------------------------------------------------------------------------------------------

class RunCreate(_In):
    spec: RunSpec


class RunPublic(_Out):
    id: int
    name: str
    status: RunStatus
    status_reason: str | None
    mode: str
    hosts_needed: int
    restarts: int
    max_restarts: int
    attempt: int
    cancel_requested: bool
    decision_id: int | None
    created_by: str | None
    owner_token_id: int | None = Field(None, description="the token that submitted the run: it (or an admin) "
                                                         "may cancel, resume or delete it")
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    last_checkpoint_step: int | None
    measured_step_s: float | None
    hardware: str | None = Field(None, description="the hardware catalog profile of the hosts reserved for it")
    predicted: dict[str, Any] | None = Field(None, description="what the placement model predicted for it there: "
                                                               "step, phases and split seconds")
    calibration_id: int | None = Field(None, description="the hardware calibration that prediction used")
    spec_digest: str
    spec: dict[str, Any]


class RunsPublic(BaseModel):
    data: list[RunPublic]
    next_cursor: str | None = Field(None, description="pass as `cursor` for the next page; null on the last")


class RunTransition(_In):
    """A worker reporting a lifecycle change. Re-sending the current state is a no-op (safe retries)."""

    to: RunStatus
    reason: str | None = Field(None, max_length=4000)
    expected: RunStatus | None = Field(None, description="fail with 409 unless the run is in this state (or already in `to`)")


class CheckpointReport(_In):
    step: int = Field(ge=0, le=2**31 - 1)
    attempt: Attempt
    host_name: ReporterHost = None


class RunHostUpsert(_In):
    host_name: str = Field(min_length=1, max_length=128)
    role: HostRole
    status: HostProcessStatus
    attempt: Attempt
    pid: int | None = Field(None, ge=0, le=2**31 - 1)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    exit_code: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    address: str | None = Field(None, max_length=255, pattern=r"^[A-Za-z0-9.:\[\]_-]+:[0-9]{1,5}$",
                                description="process 0: its JAX coordinator ADDR:PORT")
    reason: str | None = Field(None, max_length=4000, description="why the process ended (kept as a run event)")


class RunHostPublic(_Out):
    run_id: int
    attempt: int
    process_index: int
    host_name: str
    role: HostRole
    status: HostProcessStatus
    pid: int | None
    started_at: datetime | None
    ended_at: datetime | None
    exit_code: int | None
    address: str | None
    updated_at: datetime


class RunHostsPublic(BaseModel):
    data: list[RunHostPublic]


# --- metrics ----------------------------------------------------------------------------------------

MetricKey = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_./:@-]+$")]
HostIndex = Annotated[int, Field(ge=AGGREGATE_HOST, le=65535, description="process index; -1 = aggregated")]
Step = Annotated[int, Field(ge=0, le=2**31 - 1)]
# JSON has no NaN/inf; storing one would make every later read of its series unserialisable.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


# pydantic renders constrained dict keys as `patternProperties`, which leaves other keys unconstrained
# in the published schema; say exactly what is accepted instead.
_VALUES_SCHEMA = {
    "type": "object", "minProperties": 1, "maxProperties": 1000,
    "propertyNames": {"type": "string", "minLength": 1, "maxLength": 200, "pattern": r"^[A-Za-z0-9_./:@-]+$"},
    "additionalProperties": {"type": "number"},
    "description": "metric name -> finite value, e.g. {\"reward/mean\": 0.31, \"time/step\": 0.84}",
}


class MetricRow(_In):
    """All values of one step of one host."""

    step: Step
    host: HostIndex = AGGREGATE_HOST
    values: Annotated[dict[MetricKey, FiniteFloat], Field(min_length=1, max_length=1000), WithJsonSchema(_VALUES_SCHEMA)]


class MetricsBatch(_In):
    rows: list[MetricRow] = Field(min_length=1, max_length=100_000)
    attempt: Attempt
    host_name: ReporterHost = None


class IngestResult(BaseModel):
    run_id: int
    values: int = Field(description="values written (inserted or updated)")


class MetricSeries(BaseModel):
    """Columnar points of one (key, host). With downsampling each point is one bucket of steps:
    `steps`/`last` are the bucket's last step and its value, `min`/`max` the range inside the bucket."""

    key: str
    host: int
    steps: list[int]
    last: list[float]
    min: list[float]
    max: list[float]
    bucket_steps: int = Field(description="steps per bucket; 1 = raw points")


class MetricHistory(BaseModel):
    run_id: int
    max_points: int
    series: list[MetricSeries]


class MetricLatest(BaseModel):
    step: int
    value: float


class MetricSummary(BaseModel):
    run_id: int
    host: int
    last_step: int | None
    values: dict[str, MetricLatest]


class MetricKeys(BaseModel):
    run_id: int
    keys: list[str]
    hosts: list[int]


class MetricDelivery(BaseModel):
    key: str
    host: int
    values_posted: int = Field(description="values of this series the API received, every retry and repeat counted")
    values_stored: int = Field(description="rows stored: one per step")


class MetricDeliveries(BaseModel):
    """Per series: posted against stored. A duplicate delivery shows as posted > stored."""

    run_id: int
    series: list[MetricDelivery]


# --- events -----------------------------------------------------------------------------------------

EventLevel = Literal["debug", "info", "warning", "error"]


class EventCreate(_In):
    message: str = Field(max_length=65536)
    level: EventLevel = "info"
    # No `source` or `ts`: the server sets both (the reporting host process, and when it arrived), so a
    # worker cannot post events in another host's (or the scheduler's) name or back-date them.
    seq: int | None = Field(None, ge=0, le=2**62, description="per-source sequence number; repeats are ignored")


class EventsCreate(_In):
    events: list[EventCreate] = Field(min_length=1, max_length=10_000)
    attempt: Attempt
    host_name: ReporterHost = None


class EventsAccepted(BaseModel):
    run_id: int
    accepted: int = Field(description="events stored (repeated seq numbers are skipped)")


class EventPublic(_Out):
    id: int
    run_id: int
    ts: datetime
    level: str
    source: str
    message: str
    seq: int | None


class EventsPublic(BaseModel):
    data: list[EventPublic]
    next_after: int = Field(description="pass as `after` to continue; equals `after` when nothing is new")


# --- hosts ------------------------------------------------------------------------------------------

HostName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]

HOST_INFO_MAX_BYTES = 16 * 1024  # a host's free-form facts, as compact JSON; every hosts page shows them


def _bounded_info(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None:
        size = len(json.dumps(value, separators=(",", ":"), default=str).encode())
        if size > HOST_INFO_MAX_BYTES:
            raise ValueError(f"info is {size} bytes as JSON; at most {HOST_INFO_MAX_BYTES} are stored")
    return value


class HostRegister(_In):
    name: HostName
    slice: str | None = Field(None, max_length=128)
    device_kind: str = Field("cpu", min_length=1, max_length=64,
                             description="a hardware catalog name (GET /api/v1/catalog/hardware), e.g. tpu-v5e or "
                                         "local-cpu, as `locojax worker` finds it; older workers send JAX's own name")
    device_count: int = Field(1, ge=0, le=4096)
    device_memory_bytes: int | None = Field(None, ge=0, le=2**50, description="one device's memory, as JAX reports it")
    info: dict[str, Any] = Field(default_factory=dict, description="free-form facts: cores, versions, ... "
                                                                  "(at most 16 KiB as JSON)")

    _info_size = field_validator("info")(_bounded_info)


class HostHeartbeat(_In):
    info: dict[str, Any] | None = Field(None, description="replaces the stored info when given (at most 16 KiB); "
                                                       "its `instance`, if any, must be the registered worker's")

    _info_size = field_validator("info")(_bounded_info)


HostLiveness = Literal["ONLINE", "STALE", "LOST"]


class HostPublic(BaseModel):
    name: str
    slice: str | None
    device_kind: str
    device_count: int
    device_memory_bytes: int | None = None
    hardware: str | None = Field(None, description="the hardware catalog profile its device kind names, if any")
    status: HostLiveness = Field(description="derived from heartbeat age (and the reconciler's LOST mark)")
    heartbeat_age_s: float
    last_heartbeat: datetime
    registered_at: datetime
    reserved_by_run_id: int | None
    info: dict[str, Any] = Field(description="what the worker reported, less its private `instance` nonce")


class HostsPublic(BaseModel):
    data: list[HostPublic]


# --- placement --------------------------------------------------------------------------------------

class PlacementRecommendRequest(_In):
    model: str = Field(min_length=1, max_length=64, description="a name from GET /api/v1/catalog/models")
    hardware: str = Field(min_length=1, max_length=64, description="a name from GET /api/v1/catalog/hardware")
    chips: int = Field(ge=1, le=65536)
    chips_per_host: int | None = Field(None, ge=1, le=64)
    workload: str = Field(min_length=1, max_length=64, description="a name from GET /api/v1/catalog/workloads")
    prompts_per_step: int | None = Field(None, ge=1, le=1_000_000)
    group_size: int | None = Field(None, ge=1, le=4096)
    prompt_len: int | None = Field(None, ge=1, le=1_000_000)
    gen_len: int | None = Field(None, ge=1, le=1_000_000)


class PlacementOptionPublic(BaseModel):
    mode: str
    chips: int
    hosts: int
    rollout_fraction: float | None
    step_time_s: float
    device_s: float
    host_s: float
    network_s: float
    breakdown: dict[str, Any]


class DecisionPublic(_Out):
    id: int
    created_at: datetime
    created_by: str | None
    request: dict[str, Any]
    options: list[dict[str, Any]]
    choice: dict[str, Any]
    reason: str
    mode: str
    predicted_step_s: float
    measured_step_s: float | None
    measured_at: datetime | None
    measured_run_id: int | None
    calibration_id: int | None = Field(None, description="the hardware calibration its options were priced with "
                                                         "(null: the catalog's constants)")


class DecisionsPublic(BaseModel):
    data: list[DecisionPublic]
    next_cursor: str | None = None


# --- calibration ------------------------------------------------------------------------------------

Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class ObservationImport(_In):
    """A run measured elsewhere, as `locojax.placement.calibration.observation_payload` reads it from a
    `locojax train` run directory (what `locojax calibration import` sends)."""

    label: str = Field(min_length=1, max_length=255, description="the run directory's name")
    digest: Digest = Field(description="SHA-256 of its spec.yaml, metrics.jsonl and environment.json: importing "
                                       "the same directory again returns the same observation")
    hardware: str = Field(min_length=1, max_length=64, description="the catalog profile it measured")
    device_kind: str = Field(min_length=1, max_length=64, description="JAX's name of its devices")
    device_count: int = Field(ge=1, le=65536)
    finished: bool = Field(description="its result.json says it succeeded")
    spec: RunSpec
    model: dict[str, Any] = Field(description="the ModelConfig fields of the model it trained")
    measured: dict[str, Any] = Field(description="StepMeasurement: median step and phase seconds after warm-up, "
                                                 "steady steps counted")


class ObservationPublic(_Out):
    id: int
    hardware: str
    device_kind: str
    device_count: int
    source: Literal["run", "import"]
    run_id: int | None
    label: str
    finished: bool
    spec: dict[str, Any]
    model: dict[str, Any]
    measured: dict[str, Any]
    predicted: dict[str, Any] | None = Field(description="what the placement model predicted before it joined")
    calibration_id: int | None = Field(description="the calibration that made that prediction")
    rel_error: float | None = Field(None, description="(predicted - measured) / measured step time")
    measured_at: datetime
    created_at: datetime
    created_by: str | None
    excluded_at: datetime | None
    excluded_by: str | None


class ObservationsPublic(BaseModel):
    data: list[ObservationPublic]
    next_cursor: str | None = None


class CalibrationPublic(_Out):
    id: int
    hardware: str
    version: int
    created_at: datetime
    created_by: str | None
    observation_ids: list[int]
    constants: dict[str, Any]
    fit_error: dict[str, Any]
    profile: dict[str, Any]
    active: bool
    activated_at: datetime | None
    activated_by: str | None


class CalibrationsPublic(BaseModel):
    data: list[CalibrationPublic]


class ObservationImported(BaseModel):
    observation: ObservationPublic
    created: bool = Field(description="false: this run directory was imported before")
    calibration: CalibrationPublic | None = Field(description="its hardware's active calibration, refitted with it")


# --- catalog ----------------------------------------------------------------------------------------

class CatalogModel(BaseModel):
    name: str
    arch: str
    params: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    max_seq_len: int


class CatalogEntry(BaseModel):
    name: str
    attributes: dict[str, Any] = Field(default_factory=dict)


class CatalogModels(BaseModel):
    data: list[CatalogModel]


class CatalogEntries(BaseModel):
    data: list[CatalogEntry]


class CatalogNames(BaseModel):
    data: list[str]


# --- tokens -----------------------------------------------------------------------------------------

Scope = Literal["submit", "worker", "admin"]


class TokenCreate(_In):
    name: str = Field(min_length=1, max_length=128)
    scopes: list[Scope] = Field(min_length=1, max_length=3)
    expires_in_s: int | None = Field(None, ge=1, le=10 * 365 * 86400)
    hosts: str | None = Field(None, min_length=1, max_length=128,
                              description="worker tokens (required): the host name, or a `prefix*`, it acts as")


class TokenPublic(_Out):
    id: int
    name: str
    prefix: str
    scopes: list[str]
    hosts: str | None = None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None

    @field_validator("scopes", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return value.split() if isinstance(value, str) else value


class TokenCreated(TokenPublic):
    token: str = Field(description="the secret; shown once, only its hash is stored")


class TokensPublic(BaseModel):
    data: list[TokenPublic]


# --- health -----------------------------------------------------------------------------------------

class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready"]
    checks: dict[str, str]
