"""Host inventory: registration and heartbeats from workers, liveness derived from heartbeat age.

The stored status is ONLINE or LOST (the reconciler marks LOST); what clients see adds STALE: a host
that missed heartbeats for `host_stale_s` but not yet `host_lost_s`. Any heartbeat brings a host back.

A worker names its process in `info["instance"]`, a random nonce new at every start. It is what tells a
restarted worker from the live one (and either from an impersonator holding a token for the same hosts),
so it is known only to that worker and the server: no reader is shown it, and only a registration sets it.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.errors import ConflictError, NotFoundError
from server.models import Host, HostRecordStatus, utcnow
from server.schemas import HostPublic, HostRegister
from server.services import calibration, lifecycle
from server.settings import Settings


INSTANCE = "instance"  # the key of the worker's nonce in a host's `info`


def liveness(host: Host, settings: Settings, now: datetime) -> tuple[str, float]:
    age = max(0.0, (now - host.last_heartbeat).total_seconds())
    if host.status == HostRecordStatus.LOST or age >= settings.host_lost_s:
        return "LOST", age
    return ("STALE" if age >= settings.host_stale_s else "ONLINE"), age


def to_public(host: Host, settings: Settings, now: datetime | None = None) -> HostPublic:
    status, age = liveness(host, settings, now or utcnow())
    return HostPublic(
        name=host.name, slice=host.slice, device_kind=host.device_kind, device_count=host.device_count,
        device_memory_bytes=host.device_memory_bytes, hardware=calibration.hardware_of_kind(host.device_kind),
        status=status, heartbeat_age_s=round(age, 3), last_heartbeat=host.last_heartbeat,
        registered_at=host.registered_at, reserved_by_run_id=host.reserved_by_run_id,
        # Shown, the nonce would let any reader re-register as the live worker (check_takeover).
        info={key: value for key, value in (host.info or {}).items() if key != INSTANCE},
    )


def check_takeover(session: Session, report: HostRegister, settings: Settings, now: datetime | None = None) -> None:
    """409 HOST_IN_USE when `report` names a host whose current worker (another `info["instance"]`) is
    still heartbeating: a second worker (or an impersonator holding a token for that host) must not
    take over a live host and its runs. Once the old worker's heartbeat is `host_stale_s` old, the new
    one may register (a restarted worker waits at most that long)."""
    previous = session.scalar(select(Host).where(Host.name == report.name))
    if previous is None:
        return
    old, new = (previous.info or {}).get(INSTANCE), report.info.get(INSTANCE)
    if old is None or old == new:
        return
    status, age = liveness(previous, settings, now or utcnow())
    if status == "ONLINE":
        raise ConflictError(f"host {report.name} is live under another worker (last heartbeat {age:.1f} s ago); "
                            f"a new worker may register it once that one is {settings.host_stale_s:g} s silent",
                            code="HOST_IN_USE", details={"host": report.name, "heartbeat_age_s": round(age, 3),
                                                         "stale_after_s": settings.host_stale_s})


def register(session: Session, report: HostRegister) -> Host:
    """Idempotent: a worker re-registers on every start; its reservation (if any) is kept.

    A worker names its process in `info["instance"]` (new at every start). When a host registers with
    another instance than before, its previous worker is gone, and so is every engine process that
    worker had started (they die with it): those are marked LOST at once and their runs recover. A
    worker restarted within `host_lost_s` (compose, systemd) would otherwise keep heartbeating for a
    process that no longer exists, and a one-host run would wait forever.
    """
    now = utcnow()
    previous = session.scalar(select(Host).where(Host.name == report.name))
    instance = report.info.get(INSTANCE)
    if previous is not None and instance is not None and (previous.info or {}).get(INSTANCE) not in (None, instance):
        # Runs are locked before the host row, the order run transitions use.
        lifecycle.lose_processes_on(session, report.name, "its worker restarted", source="hosts",
                                    claimed_only=True, now=now)
    for _ in range(2):
        host = session.scalar(select(Host).where(Host.name == report.name))
        if host is None:
            host = Host(name=report.name, registered_at=now)
            session.add(host)
        host.slice = report.slice
        host.device_kind = report.device_kind
        host.device_count = report.device_count
        host.device_memory_bytes = report.device_memory_bytes
        host.info = report.info
        host.status = HostRecordStatus.ONLINE
        host.last_heartbeat = now
        try:
            session.commit()
            return host
        except IntegrityError:  # registered concurrently under the same name: update that row instead
            session.rollback()
    raise ConflictError(f"host {report.name} is being registered concurrently", code="HOST_CONFLICT")


def heartbeat(session: Session, name: str, info: dict | None) -> Host:
    """`info` replaces the stored info, but never the worker's instance: a heartbeat naming another
    instance than the registered one is a 409 HOST_IN_USE (else any holder of a token for this host could
    rename the live worker with a heartbeat and then register as it). A new worker registers instead."""
    host = get(session, name)
    if info is not None:
        registered = (host.info or {}).get(INSTANCE)
        if INSTANCE in info and info[INSTANCE] != registered:
            raise ConflictError(f"info.instance: host {name} is registered by another worker instance; a heartbeat "
                                "cannot change it (a new worker registers the host)", code="HOST_IN_USE",
                                details={"host": name, "field": "info.instance"})
        host.info = {**info, INSTANCE: registered} if registered is not None else info
    host.last_heartbeat = utcnow()
    host.status = HostRecordStatus.ONLINE
    session.commit()
    return host


def get(session: Session, name: str) -> Host:
    host = session.scalar(select(Host).where(Host.name == name))
    if host is None:
        raise NotFoundError(f"host {name} not found", code="HOST_NOT_FOUND")
    return host


def list_all(session: Session) -> list[Host]:
    return list(session.scalars(select(Host).order_by(Host.name)))


def remove(session: Session, name: str) -> None:
    host = get(session, name)
    if host.reserved_by_run_id is not None:
        raise ConflictError(f"host {name} is reserved by run {host.reserved_by_run_id}", code="HOST_RESERVED",
                            details={"run_id": host.reserved_by_run_id})
    session.delete(host)
    session.commit()
