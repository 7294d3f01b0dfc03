"""The scheduler loop: runs `services.scheduling.tick` every `scheduler_interval_s` in a thread of the
API process and sends the start messages it returns through Celery.

A failing tick (database or broker down) is logged and retried on the next one: every decision is in
the database, so the loop itself holds no state worth losing.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from typing import Protocol

from sqlalchemy.exc import InterfaceError, OperationalError

from locojax.contract import MESSAGE_SERIALIZER, START_HOST_TASK, host_queue
from server.db import Database
from server.models import utcnow
from server.services import scheduling
from server.services.scheduling import StartMessage
from server.settings import Settings

log = logging.getLogger("locojax.scheduler")


class Dispatcher(Protocol):
    def send(self, message: StartMessage) -> None: ...

    def close(self) -> None: ...


class CeleryDispatcher:
    """Sends `start_host` to the queue of the host a message names. A sending client only: how the hosts
    consume (acknowledgement, prefetch, redelivery) is their Celery app's (worker.app)."""

    def __init__(self, broker_url: str):
        from celery import Celery

        self.app = Celery("locojax", broker=broker_url, set_as_current=False)
        # No result backend: outcomes are reported to the API, which records them in the database.
        self.app.conf.update(task_serializer=MESSAGE_SERIALIZER, task_ignore_result=True)

    def send(self, message: StartMessage) -> None:
        self.app.send_task(START_HOST_TASK, kwargs=message.task_kwargs(), queue=host_queue(message.host_name),
                           retry=True, retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5})

    def close(self) -> None:
        self.app.close()


class SchedulerLoop:
    def __init__(self, db: Database, settings: Settings, dispatcher: Dispatcher):
        self.db = db
        self.settings = settings
        self.dispatcher = dispatcher
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="locojax-scheduler", daemon=True)
        self._watching_since: datetime | None = None  # since when ticks have reached the database unbroken

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Look now (a run was submitted, resumed or cancelled) instead of at the next interval."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self.dispatcher.close()

    def tick(self) -> int:
        # Heartbeats reach the database only through the API; while this loop could not reach the
        # database (or this API process was not running) hosts could not report, so the reconciler
        # only judges heartbeats it has been able to watch for a while (see scheduling.check_hosts).
        since = self._watching_since or utcnow()
        try:
            with self.db.write_session() as session:
                messages = scheduling.tick(session, self.settings, watching_since=since)
        except (OperationalError, InterfaceError):
            self._watching_since = None  # the database is unreachable; so it is for the heartbeats
            raise
        self._watching_since = since
        for message in messages:
            self.dispatcher.send(message)
            log.info("sent start_host run=%s attempt=%s process=%s to %s", message.run_id, message.attempt,
                     message.process_index, message.host_name)
        return len(messages)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the next tick retries; the database holds the decisions
                log.exception("scheduler tick failed; retrying")
            self._wake.wait(self.settings.scheduler_interval_s)
            self._wake.clear()
