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
from worker.protocol import START_HOST_TASK, host_queue, make_celery
from worker.supervisor import HostSupervisor, WorkerContext

log = logging.getLogger("locojax.worker")


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
               engine_env: dict[str, str] | None = None, runs_root: Path = Path("runs")) -> None:
    """Block running the worker until it is told to stop (SIGTERM/SIGINT)."""
    if cores:
        os.sched_setaffinity(0, cores)  # the engine processes it starts inherit the pinning
    context = WorkerContext(host_name=name, api=api, address=address, devices=devices, reward_modules=reward_modules,
                            ray_address=ray_address, engine_env=engine_env or {}, runs_root=runs_root)
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
