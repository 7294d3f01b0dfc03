"""Compare runs: one metric of up to ten runs overlaid on one chart, with a table of their last values."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request
from starlette.responses import Response

from locojax.contract import REWARD_MEAN
from server.api.deps import MAX_INT32, SessionDep, SettingsDep
from server.models import AGGREGATE_HOST
from server.services import dashboard as dashboard_service
from server.services import metrics as metric_service
from server.services import runs as run_service
from web.charts import Chart, chart_data
from web.auth import ViewerDep
from web.routing import dashboard_router
from web.templating import render

router = dashboard_router()

MAX_RUNS = 10
DEFAULT_KEY = REWARD_MEAN


@router.get("/compare")
def compare(request: Request, session: SessionDep, settings: SettingsDep, _: ViewerDep,
            run: Annotated[list[int], Query(max_length=50)] = [],
            key: Annotated[str, Query(max_length=200)] = DEFAULT_KEY) -> Response:
    notes = []
    wanted = [run_id for run_id in dict.fromkeys(run) if 1 <= run_id <= MAX_INT32]
    if len(wanted) > MAX_RUNS:
        notes.append(f"showing the first {MAX_RUNS} of the {len(wanted)} runs selected")
        wanted = wanted[:MAX_RUNS]
    runs = []
    for run_id in wanted:
        found = dashboard_service.find_run(session, run_id)
        if found is None:
            notes.append(f"run {run_id} does not exist")
        else:
            runs.append(found)
    keys: set[str] = set()
    series = {}
    for found in runs:
        keys.update(metric_service.keys(session, found.id)[0])
        one = metric_service.history(session, found.id, [key], [AGGREGATE_HOST],
                                     max_points=settings.dashboard_chart_points)[0]
        series[f"run {found.id}"] = one.model_copy(update={"key": f"run {found.id}"})
    labels = [f"#{found.id} {found.name}" for found in runs]
    chart = chart_data(Chart("compare", key, tuple(series)), series, labels) if runs else None
    recent, _ = run_service.list_page(session, limit=50)
    return render(request, "compare.html", runs=runs, key=key, keys=sorted(keys | {key}), chart=chart, notes=notes,
                  recent=recent, selected={found.id for found in runs}, max_runs=MAX_RUNS)
