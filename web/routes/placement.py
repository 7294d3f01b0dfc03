"""The placement explorer: model, hardware, chips and workload in; ranked options out, each with its
predicted device/host/network split, the recommender's reason, and a link that opens the new-run form
with that placement.

Asking stores a placement decision (as the API's recommend does), so a run submitted from the top option
carries the decision and later shows predicted beside measured step time. Below the explorer, what the
model learned from measured runs (`web.learning`): each hardware's prediction error per run over time,
its observations and calibration versions, where an admin excludes an observation or returns to a version. The answer lives at
`/placement?decision=<id>`: a plain form post redirects there, and htmx swaps in the options and puts
that address in the location bar.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlencode

import anyio
from fastapi import Path, Query, Request
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.responses import RedirectResponse, Response

from server.api.deps import SessionDep
from server.errors import InvalidInputError
from server.models import PlacementDecision
from server.schemas import PlacementRecommendRequest
from server.services import calibration as calibration_service
from server.services import placement as placement_service
from web import forms
from web import learning as learning_view
from web.auth import AdminDep, SubmitterDep, Viewer, ViewerDep
from web.routing import dashboard_router
from web.templating import is_htmx, render

router = dashboard_router()

REQUEST_FIELDS = ("model", "hardware", "chips", "chips_per_host", "workload", "prompts_per_step", "group_size",
                  "prompt_len", "gen_len")
DEFAULTS = {"model": "qwen3-0.6b", "hardware": "tpu-v5e", "chips": "8", "workload": "gsm8k"}


def _options(decision: PlacementDecision) -> list[dict[str, Any]]:
    """The ranked options with what the page draws: bar widths against the slowest option, and the
    query that prefills the new-run form (the decision id only on the recommended option)."""
    slowest = max((option.get("step_time_s") or 0.0 for option in decision.options), default=0.0)
    views = []
    for rank, option in enumerate(decision.options, start=1):
        chosen = option == decision.choice
        query = forms.option_query(option, decision.request, decision.id if chosen else None)
        views.append({"rank": rank, "option": option, "chosen": chosen, "scale": slowest,
                      "submit_url": "/runs/new?" + urlencode(query)})
    return views


def _show(request: Request, session: Session, values: dict[str, str], *, decision: PlacementDecision | None = None,
          errors: dict[str, list[str]] | None = None, status_code: int = 200,
          headers: dict[str, str] | None = None) -> Response:
    context = dict(values=values, field_errors=errors or {}, decision=decision,
                   options=_options(decision) if decision is not None else [], models=forms.model_names(),
                   hardware=forms.hardware_names(), workloads=forms.workload_names())
    if is_htmx(request):
        return render(request, "_placement_explorer.html", status_code=status_code, headers=headers, **context)
    return render(request, "placement.html", status_code=status_code, headers=headers,
                  learning=learning_view.learning(session), **context)


@router.get("/placement")
def explorer(request: Request, session: SessionDep, _: ViewerDep,
             decision: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None) -> Response:
    values = dict(DEFAULTS)
    found = None
    if decision is not None:
        found = placement_service.get(session, decision)
        values.update({name: str(value) for name, value in found.request.items() if value is not None})
    return _show(request, session, values, decision=found)


@router.post("/placement")
async def explore(request: Request, session: SessionDep, viewer: SubmitterDep) -> Response:
    form = await request.form()
    values = {name: str(form.get(name, "")).strip() for name in REQUEST_FIELDS}
    return await anyio.to_thread.run_sync(_explore, request, values, session, viewer)


def _explore(request: Request, values: dict[str, str], session: Session, viewer: Viewer) -> Response:
    errors: dict[str, list[str]] = {}
    try:
        body = PlacementRecommendRequest.model_validate({name: value for name, value in values.items() if value})
        decision = placement_service.recommend(session, body, created_by=viewer.name)
    except ValidationError as exc:
        for field, message in forms.validation_errors(exc):
            errors.setdefault(field if field in REQUEST_FIELDS else "form", []).append(message)
        return _show(request, session, values, errors=errors, status_code=422)
    except InvalidInputError as exc:
        session.rollback()
        for item in exc.details if isinstance(exc.details, list) else [{"field": "", "message": exc.message}]:
            field = str(item.get("field", ""))
            errors.setdefault(field if field in REQUEST_FIELDS else "form", []).append(str(item.get("message")))
        return _show(request, session, values, errors=errors, status_code=422)
    location = f"/placement?decision={decision.id}"
    if not is_htmx(request):
        return RedirectResponse(location, status_code=303)
    return _show(request, session, values, decision=decision, headers={"HX-Push-Url": location})


# --- what the model learned: an admin excludes an observation or returns to a calibration version ---

def _learning_changed(request: Request, session: Session) -> Response:
    """htmx: the learning section anew; a plain form: back to the page."""
    if not is_htmx(request):
        return RedirectResponse("/placement#placement-learning", status_code=303)
    return render(request, "_placement_learning.html", learning=learning_view.learning(session))


@router.post("/placement/observations/{observation_id:int}/{action}")
def set_observation(request: Request, observation_id: Annotated[int, Path(ge=1, le=2**31 - 1)],
                    action: Annotated[str, Path(pattern="^(exclude|include)$")], session: SessionDep,
                    viewer: AdminDep) -> Response:
    calibration_service.set_excluded(session, observation_id, action == "exclude", by=viewer.name)
    return _learning_changed(request, session)


@router.post("/placement/calibrations/{calibration_id:int}/activate")
def activate_calibration(request: Request, calibration_id: Annotated[int, Path(ge=1, le=2**31 - 1)],
                         session: SessionDep, viewer: AdminDep) -> Response:
    calibration_service.activate(session, calibration_id, by=viewer.name)
    return _learning_changed(request, session)
