"""The new-run form: prefilled from the query string, validated by the spec and the runs service, and
"ask the recommender", which prices placements and fills the placement fields with the best one."""

from __future__ import annotations

import anyio
from fastapi import Request
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.responses import RedirectResponse, Response

from server.api.deps import SessionDep, SettingsDep
from server.errors import InvalidInputError
from server.schemas import PlacementRecommendRequest
from server.services import placement as placement_service
from server.services import runs as run_service
from server.settings import Settings
from web import forms
from web.auth import SubmitterDep, Viewer, ViewerDep
from web.routing import dashboard_router
from web.templating import is_htmx, render

router = dashboard_router()


def _show(request: Request, form: forms.RunForm, status_code: int = 200,
          partial: str = "_new_run_form.html") -> Response:
    return render(request, partial if is_htmx(request) else "new_run.html", status_code=status_code, form=form,
                  groups=forms.GROUPS, hardware=forms.hardware_names(), workloads=forms.workload_names())


@router.get("/runs/new")
def new_run_form(request: Request, _: ViewerDep) -> Response:
    return _show(request, forms.RunForm.from_mapping(request.query_params))


@router.post("/runs/new")
async def submit_run(request: Request, session: SessionDep, settings: SettingsDep, viewer: SubmitterDep) -> Response:
    form = forms.RunForm.from_mapping(await request.form())
    # YAML parsing and the database work run in a worker thread, never on the event loop.
    return await anyio.to_thread.run_sync(_submit, request, form, session, settings, viewer)


def _submit(request: Request, form: forms.RunForm, session: Session, settings: Settings, viewer: Viewer) -> Response:
    spec = form.spec()
    if spec is None:
        return _show(request, form, 422)
    try:
        run, _ = run_service.create(session, spec, settings, created_by=viewer.name,
                                    owner_token_id=viewer.token_id)
    except InvalidInputError as exc:  # paths outside the allowed roots, an unknown decision id
        session.rollback()
        form.place_service_errors(exc.details, exc.message)
        return _show(request, form, 422)
    target = f"/runs/{run.id}"
    if is_htmx(request):
        return Response(status_code=204, headers={"HX-Redirect": target})
    return RedirectResponse(target, status_code=303)


@router.post("/runs/new/recommend")
async def recommend_for_form(request: Request, session: SessionDep, viewer: SubmitterDep) -> Response:
    """Store a placement decision for the form's model, workload and chips; fill in its choice."""
    form = forms.RunForm.from_mapping(await request.form())
    return await anyio.to_thread.run_sync(_recommend, request, form, session, viewer)


def _recommend(request: Request, form: forms.RunForm, session: Session, viewer: Viewer) -> Response:
    try:
        body = PlacementRecommendRequest.model_validate(form.recommend_request())
        decision = placement_service.recommend(session, body, created_by=viewer.name)
    except ValidationError as exc:
        form.place_recommend_errors(forms.validation_errors(exc))
        return _show(request, form, 422, "_placement_fields.html")
    except InvalidInputError as exc:
        session.rollback()
        details = exc.details if isinstance(exc.details, list) else []
        form.place_recommend_errors([(str(item.get("field", "")), str(item.get("message", exc.message)))
                                     for item in details] or [("", exc.message)])
        return _show(request, form, 422, "_placement_fields.html")
    form.apply_option(decision.choice, decision.id)
    form.recommendation = decision
    return _show(request, form, 200, "_placement_fields.html")
