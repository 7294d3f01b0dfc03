"""What every end-to-end control plane in tests/worker shares: its settings (fast scheduler ticks,
short stale/lost/kill timeouts), an emptied Redis database of its own, and a stop that leaves no
process behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from server.embedded import ControlPlane
from server.settings import Settings


def plane_settings(tmp: Path, database_url: str, broker_url: str, **extra: Any) -> Settings:
    return Settings(
        home=tmp / "home", database_url=database_url, broker_url=broker_url, migrate_on_start=False,
        runs_root=tmp / "runs", data_roots=[tmp], scheduler_interval_s=0.3, host_stale_s=4.0, host_lost_s=10.0,
        start_timeout_s=120.0, kill_timeout_s=20.0, log_level="warning", **extra)


def emptied_redis(url: str) -> str:
    """`url`, its database emptied first (each module has one of its own); skips when Redis is down."""
    try:
        redis.Redis.from_url(url).flushdb()
    except redis.ConnectionError as exc:
        pytest.skip(f"Redis not reachable: {exc}")
    return url


def stop_leaving_nothing(control_plane: ControlPlane) -> None:
    control_plane.stop()
    assert [name for name, process in control_plane.processes.items() if process.poll() is None] == []
