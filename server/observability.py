"""Prometheus metrics of one app instance (its own registry, so several apps can live in one process).

Request counts and latencies are labelled by route template (`/api/v1/runs/{run_id}`), never by raw
path, to keep label cardinality bounded. Runs per status and hosts per liveness are read from the
database at scrape time, so they are right no matter which process changed them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.models import Host, Run, RunStatus, utcnow

if TYPE_CHECKING:
    from server.db import Database
    from server.settings import Settings


class _StateCollector:
    def __init__(self, db: "Database", settings: "Settings"):
        self.db = db
        self.settings = settings

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from server.services.hosts import liveness

        runs = GaugeMetricFamily("locojax_runs", "runs per status", labels=["status"])
        hosts = GaugeMetricFamily("locojax_hosts", "hosts per liveness", labels=["status"])
        try:
            with self.db.read_session() as session:
                counts = dict(session.execute(select(Run.status, func.count()).group_by(Run.status)).tuples().all())
                now = utcnow()
                host_counts = {"ONLINE": 0, "STALE": 0, "LOST": 0}
                for host in session.scalars(select(Host)):
                    host_counts[liveness(host, self.settings, now)[0]] += 1
        except Exception:  # a scrape during a database outage reports the request metrics only
            return
        for status in RunStatus:
            runs.add_metric([status.value], counts.get(status, 0))
        for status, count in host_counts.items():
            hosts.add_metric([status], count)
        yield runs
        yield hosts


class Prometheus:
    def __init__(self, db: "Database", settings: "Settings"):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("locojax_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("locojax_http_request_duration_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
        self.metric_values = Counter("locojax_metric_values_ingested", "metric values written by ingest",
                                     registry=self.registry)
        self.registry.register(_StateCollector(db, settings))


class PrometheusMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, prometheus: Prometheus):
        self.app = app
        self.prometheus = prometheus

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status_code = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            method = scope.get("method", "")
            self.prometheus.requests.labels(method, template, str(status_code)).inc()
            self.prometheus.latency.labels(method, template).observe(time.perf_counter() - start)
