"""The host worker: a Celery worker consuming its own queue `host.<name>`, one task at a time, plus a
thread that registers the host with the API and heartbeats.

The Celery task is thin (STYLE habit 5): it hands the message to `HostSupervisor`, which re-reads the
run from the API and is safe to receive twice.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
from celery import Celery

from locojax.client import ApiClient, ApiClientError
from locojax.contract import MESSAGE_SERIALIZER, START_HOST_TASK, host_queue
from worker.supervisor import HostSupervisor, WorkerContext

log = logging.getLogger("locojax.worker")


def make_celery(broker_url: str) -> Celery:
    """The Celery app of a host worker, which consumes its host's queue (the scheduler sends with a client
    of its own, server.scheduler; both take the task's name, queues and message format from the contract).

    Settings, chosen for tasks that run as long as a training run (hours to weeks):
    * `task_acks_late=False`: a start message is acknowledged when the worker takes it. With late acks a
      Redis broker redelivers any message held longer than `visibility_timeout`, which would start a
      second copy of a live host. A message lost with its worker is not redelivered by the broker; the
      database is the source of truth and the scheduler re-sends unanswered starts (`dispatch_resend_s`)
      and restarts groups whose host died (heartbeats), so nothing depends on redelivery.
    * `worker_prefetch_multiplier=1` with one execution slot: a host holds at most one waiting start
      message, so a message meant for the next attempt waits in the broker, not inside a busy worker.
    * `visibility_timeout` (Redis) only matters for prefetched, not yet started messages; one hour
      returns them to the queue if their worker vanished before starting them.
    * No result backend: outcomes are reported to the API, which records them in the database.
    * Broker connection retries forever: a Redis restart pauses delivery; running hosts carry on.
    """
    app = Celery("locojax", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer=MESSAGE_SERIALIZER,
        accept_content=[MESSAGE_SERIALIZER],
        task_default_queue="locojax.default",
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_transport_options={"visibility_timeout": 3600} if broker_url.startswith("redis") else {},
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        enable_utc=True,
    )
    if broker_url.startswith("sqla+"):
        # The embedded broker polls SQLite. kombu passes transport options to create_engine, so the
        # interval is set on the class: 50 ms makes a dispatch take well under a second (default ~1 s).
        from kombu.transport import sqlalchemy as kombu_sqlalchemy

        kombu_sqlalchemy.Transport.polling_interval = 0.05
    return app


def create_worker_app(broker_url: str, context: WorkerContext) -> Celery:
    app = make_celery(broker_url)

    @app.task(name=START_HOST_TASK, ignore_result=True)
    def start_host(**message: Any) -> str:
        return HostSupervisor(context, **message).run()

    return app


class Heartbeat:
    """Registers the host on start and every time the API does not know it (e.g. its database was
    reset); heartbeats every `interval_s` until stopped. API outages are waited out, never fatal."""

    def __init__(self, api: ApiClient, name: str, *, device_kind: str, device_count: int, info: dict[str, Any],
                 interval_s: float = 2.0, slice_name: str | None = None, device_memory_bytes: int | None = None):
        self.api, self.name, self.interval_s = api, name, interval_s
        self.registration = {"device_kind": device_kind, "device_count": device_count, "info": info,
                             "slice": slice_name, "device_memory_bytes": device_memory_bytes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="heartbeat")

    def register(self) -> None:
        self.api.register_host(self.name, **self.registration)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        registered = False
        while not self._stop.is_set():
            try:
                if not registered:
                    self.register()
                    registered = True
                else:
                    self.api.heartbeat(self.name)
            except ApiClientError as exc:
                if exc.status == 404:
                    registered = False  # unknown host: register again right away
                    continue
                log.warning("heartbeat refused: %s", exc)
            except httpx.TransportError as exc:
                log.warning("heartbeat failed (API unreachable): %s", exc)
            self._stop.wait(self.interval_s)


def run_worker(name: str, api: ApiClient, broker_url: str, *, address: str, devices: int, cores: list[int] | None,
               heartbeat_s: float, slice_name: str | None = None, device_kind: str = "local-cpu",
               device_memory_bytes: int | None = None, device_info: dict[str, Any] | None = None,
               loglevel: str = "INFO", reward_modules: tuple[str, ...] = (), ray_address: str = "",
               engine_env: dict[str, str] | None = None, runs_root: Path = Path("runs"),
               compilation_cache: str = "") -> None:
    """Block running the worker until it is told to stop (SIGTERM/SIGINT)."""
    if cores:
        os.sched_setaffinity(0, cores)  # the engine processes it starts inherit the pinning
    context = WorkerContext(host_name=name, api=api, address=address, devices=devices, reward_modules=reward_modules,
                            ray_address=ray_address, engine_env=engine_env or {}, runs_root=runs_root,
                            compilation_cache=compilation_cache)
    # `instance` tells the API this is a new worker process: whatever the previous one ran is gone.
    info = {"address": address, "pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
            "instance": uuid.uuid4().hex, **(device_info or {})}
    heartbeat = Heartbeat(api, name, device_kind=device_kind, device_count=devices, info=info, interval_s=heartbeat_s,
                          slice_name=slice_name, device_memory_bytes=device_memory_bytes)
    heartbeat.start()
    app = create_worker_app(broker_url, context)
    try:
        # solo pool: the task runs in this process's main thread, so the engine process's parent-death
        # signal is tied to the worker itself, and the worker takes one start message at a time.
        app.worker_main(["worker", "--queues", host_queue(name), "--pool", "solo", "--concurrency", "1",
                         "--hostname", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
                         "--loglevel", loglevel])
    finally:
        heartbeat.stop()
