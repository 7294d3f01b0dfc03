"""What the scheduler and the workers agree on: the task name, the queue of a host, the Celery
configuration both sides build, and the engine's exit codes.

Kept free of heavy imports: the API process imports it to send start messages.
"""

from __future__ import annotations

from celery import Celery

from locojax.contract import EXIT_CANCELLED, START_HOST_TASK  # noqa: F401  (the names both sides use)


def host_queue(host_name: str) -> str:
    """Each host consumes only its own queue, so a start message reaches exactly the host it names."""
    return f"host.{host_name}"


def make_celery(broker_url: str) -> Celery:
    """The Celery app of both the producer (scheduler) and the consumers (host workers).

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
        task_serializer="json",
        accept_content=["json"],
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
