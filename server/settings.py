"""The control plane's one configuration object.

This is the only module in the repository that reads environment variables (STYLE habit 3). Everything
else receives a `Settings` instance: `create_app(settings)`, the CLI and the tests build one and pass it
down. Variables use the prefix `LOCOJAX_`, e.g. `LOCOJAX_DATABASE_URL`, `LOCOJAX_DATA_ROOTS=/data:/mnt/ds`.

Embedded defaults need no server at all: SQLite under `./.locojax/` and kombu's SQLAlchemy transport as
the broker. Production sets `LOCOJAX_DATABASE_URL=postgresql://...` and `LOCOJAX_BROKER_URL=redis://...`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# The production broker (docker-compose); kept here so the worker and the docs name one value.
PRODUCTION_BROKER_URL = "redis://127.0.0.1:6379/0"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOCOJAX_", extra="ignore", frozen=True)

    home: Path = Field(Path(".locojax"), description="state directory of the embedded control plane")
    database_url: str = Field("", description="SQLAlchemy URL; default: SQLite at <home>/locojax.db")
    broker_url: str = Field(
        "", description="Celery broker; default: SQLite via kombu's SQLAlchemy transport "
                        f"({PRODUCTION_BROKER_URL} in production)"
    )
    migrate_on_start: bool | None = Field(
        None, description="run `alembic upgrade head` when the app starts; default: only for SQLite (embedded)"
    )

    # Paths a RunSpec reads (task.path, model.checkpoint, model.tokenizer) must be absolute and inside
    # these roots (or runs_root); default: <home>/data, a directory meant for data, never the server's
    # working directory. Every run writes under runs_root/<id>-<name>, chosen by the server. Both are
    # made absolute at start-up, so the API and the workers it starts agree on them.
    data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    runs_root: Path = Path("runs")
    # A spec's reward may be `package.module:function` only under one of these module prefixes
    # (comma-separated, e.g. `LOCOJAX_REWARD_MODULES=mycompany.rewards,tests.locojax`). Empty: registered
    # rewards only. Workers read the same variable and their engine processes check it again.
    reward_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="module prefixes custom reward functions may be imported from")
    ray_address: str = Field(
        "", max_length=512, description="an operator-run Ray cluster for DA runs (a worker setting); default: each DA "
                                        "run starts a private Ray on its own host, bound to 127.0.0.1")

    bind_host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    log_level: str = "info"
    # Longer than any pooled client keeps an idle connection (httpx: 5 s, proxies: 60 s). At uvicorn's
    # default of 5 s the server closes idle connections just as httpx clients reuse them, and those
    # requests fail with ReadError: 7 of 2,121 did in a 20 s, 50-client load test (tests/e2e/test_load.py).
    keep_alive_s: int = Field(75, ge=1, description="seconds an idle keep-alive connection stays open")

    page_size_default: int = Field(50, ge=1)
    page_size_max: int = Field(200, ge=1)
    metrics_batch_max_values: int = Field(100_000, ge=1, description="values in one ingest request")
    metric_keys_per_run_max: int = Field(1_000, ge=1, description="distinct metric keys one run may hold")
    events_batch_max: int = Field(1_000, ge=1)
    history_max_points: int = Field(10_000, ge=2, description="upper bound of max_points in history queries")
    history_max_series: int = Field(64, ge=1)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)

    host_stale_s: float = Field(15.0, gt=0, description="heartbeat age after which a host shows STALE")
    host_lost_s: float = Field(60.0, gt=0, description="heartbeat age after which a host shows LOST")

    # The scheduler and reconciler (server.scheduler) run in the API process; several API replicas may
    # run them at once (PostgreSQL row locks keep them apart).
    scheduler_enabled: bool = Field(True, description="run the gang scheduler and reconciler in this API process")
    scheduler_interval_s: float = Field(0.5, gt=0, description="how often the scheduler looks at the tables")
    start_timeout_s: float = Field(60.0, gt=0, description="a host group not started by then is requeued")
    dispatch_resend_s: float = Field(10.0, gt=0, description="start messages unanswered this long are sent again")
    kill_timeout_s: float = Field(30.0, gt=0, description="an old attempt's process still alive this long after "
                                                          "a recovery began is given up as lost")
    backfill_wait_s: float = Field(120.0, ge=0, description="a QUEUED run that fits but finds too few free hosts lets "
                                                          "younger runs start first for this long, then holds "
                                                          "hosts as they free until it can start")
    requeue_backoff_s: float = Field(2.0, gt=0, description="first backoff of a requeued run; doubles per failure")
    requeue_backoff_max_s: float = Field(60.0, gt=0)

    sse_poll_s: float = Field(0.5, gt=0, description="how often an SSE follower looks for new events")
    sse_streams_per_token: int = Field(8, ge=1, description="event streams (SSE) one token may hold open at once, "
                                                            "per API process")
    sse_max_s: float = Field(
        900.0, gt=0, description="an SSE stream closes after this long; EventSource reconnects with Last-Event-ID"
    )
    readyz_timeout_s: float = Field(2.0, gt=0)
    token_touch_interval_s: float = Field(60.0, ge=0, description="how stale api_tokens.last_used_at may get")
    token_cache_s: float = Field(
        5.0, ge=0, description="authenticated tokens are remembered this long; a revocation made outside this "
                               "API process takes effect within it (0: look every token up every time)")

    # The dashboard (web/): a login exchanges an API token for a signed session cookie.
    dashboard_secret: SecretStr | None = Field(
        None, description="key that signs dashboard session cookies; default: a random key kept in "
                          "<home>/dashboard.key, so every API process sharing that home accepts the same cookies")
    dashboard_session_ttl_s: float = Field(12 * 3600.0, gt=0, description="a dashboard login lasts this long")
    dashboard_secure_cookies: bool | None = Field(
        None, description="mark the session cookie Secure; default: when the request came over https")
    trust_forwarded_proto: bool = Field(
        False, description="a proxy in front terminates TLS and sets X-Forwarded-Proto: session cookies are Secure "
                           "when it says https (set only when every request comes through that proxy)")
    login_failures_per_minute: int = Field(10, ge=1, description="failed dashboard logins per client address per "
                                                                 "minute before further tries get 429")
    trusted_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"], description="Host header values the API answers (comma-separated, "
                                                   "`*.example.com` allowed); `*`: any (the embedded default)")
    dashboard_poll_s: float = Field(2.0, gt=0, description="how often live dashboard widgets refresh")
    dashboard_chart_points: int = Field(300, ge=10, le=10_000, description="points per chart series (downsampled)")

    @field_validator("data_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        # `NoDecode` keeps pydantic-settings from JSON-decoding the env var, so a PATH-like list works.
        if isinstance(value, str):
            return [part for part in value.split(os.pathsep) if part.strip()]
        return value

    @field_validator("trusted_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.replace(os.pathsep, ",").split(",") if part.strip()]
        return value

    @field_validator("reward_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: Any) -> Any:
        from locojax.rewards import split_prefixes

        return list(split_prefixes(value)) if isinstance(value, (str, list, tuple)) else value

    @model_validator(mode="after")
    def _defaults_from_home(self) -> "Settings":
        # frozen=True: fill derived defaults through object.__setattr__ once, at construction.
        if not self.database_url:
            object.__setattr__(self, "database_url", f"sqlite:///{self.home / 'locojax.db'}")
        elif self.database_url.startswith(("postgresql://", "postgres://")):
            # psycopg 3 is the driver we ship; SQLAlchemy's bare postgresql:// means psycopg2.
            object.__setattr__(self, "database_url", "postgresql+psycopg://" + self.database_url.split("://", 1)[1])
        if not self.broker_url:
            object.__setattr__(self, "broker_url", f"sqla+sqlite:///{self.home / 'broker.db'}")
        if not self.data_roots:
            object.__setattr__(self, "data_roots", [self.home / "data"])
        object.__setattr__(self, "data_roots", [Path(os.path.abspath(root)) for root in self.data_roots])
        object.__setattr__(self, "runs_root", Path(os.path.abspath(self.runs_root)))
        if self.migrate_on_start is None:
            object.__setattr__(self, "migrate_on_start", self.is_sqlite)
        if self.host_lost_s < self.host_stale_s:
            raise ValueError("host_lost_s must be at least host_stale_s")
        if self.page_size_default > self.page_size_max:
            raise ValueError("page_size_default must not exceed page_size_max")
        return self

    def as_environment(self, **extra: str) -> dict[str, str]:
        """This process's environment with these settings as LOCOJAX_* variables (and `extra` on top):
        what a child process (the API or a worker started by `locojax up`) needs to see the same
        configuration. Secrets are passed as their real values (`model_dump` would give `**********`,
        and a child would sign dashboard cookies with that public constant)."""
        env = dict(os.environ)
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, list):
                value = os.pathsep.join(str(item) for item in value)
            elif isinstance(value, bool):
                value = "true" if value else "false"
            env[f"LOCOJAX_{name.upper()}"] = str(value)
        env.update(extra)
        return env

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Settings from the environment, read once per process (CLI and Alembic entry points only)."""
    return Settings()
