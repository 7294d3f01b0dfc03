"""What the run page shows, read through the services: header facts, host processes with heartbeat
age, the events tail, latest values, the charts' data and the placement decision (predicted vs measured).

Each function feeds one partial, so a poll of one swap target reads only what that target shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from server.models import AGGREGATE_HOST, PlacementDecision, Run, RunEvent, RunHost, RunStatus, utcnow
from server.services import dashboard as dashboard_service
from server.services import hosts as host_service
from server.services import metrics as metric_service
from server.services import runs as run_service
from server.settings import Settings
from web.charts import RUN_CHART_KEYS, RUN_CHARTS, STEP_TIME_KEY, chart_data
from web.templating import is_terminal

EVENTS_TAIL = 100  # events rendered with the page; later ones arrive over SSE


@dataclass(frozen=True)
class Header:
    run: Run
    terminal: bool
    running_s: float | None
    last_step: int | None
    total_steps: int | None
    preset: str
    task: str
    cancellable: bool = False  # a cancel would change something: live, and not already CANCELLING
    resumable: bool = False  # the lifecycle's resume edge applies (run_service.RESUMABLE)

    @property
    def progress_percent(self) -> float | None:
        if self.last_step is None or not self.total_steps:
            return None
        return min(100.0, 100.0 * (self.last_step + 1) / self.total_steps)


def running_seconds(run: Run, now: datetime | None = None) -> float | None:
    if run.started_at is None:
        return None
    end = run.finished_at or now or utcnow()
    return max(0.0, (end - run.started_at).total_seconds())


Latest = dict[str, tuple[int, float]]  # key -> (step, value) of the aggregated rows


def latest(session: Session, run_id: int) -> Latest:
    return metric_service.summary(session, run_id, AGGREGATE_HOST)


def trained_step(latest: Latest) -> int | None:
    """The last step the run trained: the one of its newest step time. Not the newest record's step,
    which is `steps` itself once the evaluation after the last step is in (locojax.metrics, eval/*)."""
    if STEP_TIME_KEY in latest:
        return latest[STEP_TIME_KEY][0]
    return max((step for step, _ in latest.values()), default=None)


def header(run: Run, latest: Latest) -> Header:
    spec = run.spec or {}
    status = RunStatus(run.status)
    return Header(
        run=run, terminal=is_terminal(run.status), running_s=running_seconds(run),
        cancellable=not status.terminal and status is not RunStatus.CANCELLING,
        resumable=status in run_service.RESUMABLE,
        last_step=trained_step(latest), total_steps=spec.get("steps"),
        preset=str((spec.get("model") or {}).get("preset", "")), task=str((spec.get("task") or {}).get("name", "")),
    )


@dataclass(frozen=True)
class HostProcessView:
    process: RunHost
    host_status: str | None  # ONLINE / STALE / LOST of the machine, None if it is not in the inventory
    heartbeat_age_s: float | None


def host_processes(session: Session, run: Run, settings: Settings) -> list[HostProcessView]:
    processes = run_service.list_host_processes(session, run.id, None)
    names = {process.host_name for process in processes}
    machines = dashboard_service.hosts_named(session, names)
    now = utcnow()
    views = []
    for process in processes:
        machine = machines.get(process.host_name)
        status, age = host_service.liveness(machine, settings, now) if machine is not None else (None, None)
        views.append(HostProcessView(process, status, age))
    return views


def events_tail(session: Session, run_id: int, limit: int = EVENTS_TAIL) -> list[RunEvent]:
    return dashboard_service.events_tail(session, run_id, limit)


def charts(session: Session, run_id: int, settings: Settings) -> list[dict[str, Any]]:
    series = metric_service.history(session, run_id, RUN_CHART_KEYS, [AGGREGATE_HOST],
                                    max_points=settings.dashboard_chart_points)
    by_key = {one.key: one for one in series}
    return [chart_data(chart, by_key) for chart in RUN_CHARTS]


def charts_payload(session: Session, run: Run, settings: Settings) -> dict[str, Any]:
    """The JSON the page's script polls while the run is live; `terminal` tells it to stop."""
    return {"run_id": run.id, "status": RunStatus(run.status).value, "terminal": is_terminal(run.status),
            "charts": charts(session, run.id, settings)}


@dataclass(frozen=True)
class DecisionView:
    decision: PlacementDecision
    option: dict[str, Any]  # the priced option matching the run's placement (else the recommended one)
    follows_choice: bool
    predicted_s: float | None
    measured_s: float | None
    measured_label: str  # "median over the run" once finished, "latest step" while running

    @property
    def ratio(self) -> float | None:
        if not self.predicted_s or self.measured_s is None:
            return None
        return self.measured_s / self.predicted_s


def _matching_option(decision: PlacementDecision, run: Run) -> dict[str, Any] | None:
    placement = (run.spec or {}).get("placement") or {}
    for option in decision.options:
        if (option.get("mode") == run.mode and option.get("hosts") == run.hosts_needed
                and option.get("rollout_fraction") == placement.get("rollout_fraction")):
            return option
    return None


def decision(session: Session, run: Run, latest: Latest) -> DecisionView | None:
    if run.decision_id is None:
        return None
    found = dashboard_service.find_decision(session, run.decision_id)
    if found is None:
        return None
    option = _matching_option(found, run)
    follows = option is None or option == found.choice
    option = option or found.choice
    measured, label = run.measured_step_s, "median over the run"
    if measured is None:
        step_time = latest.get(STEP_TIME_KEY)
        measured, label = (step_time[1], f"latest step ({step_time[0]})") if step_time else (None, "")
    return DecisionView(decision=found, option=option, follows_choice=follows,
                        predicted_s=option.get("step_time_s"), measured_s=measured, measured_label=label)
