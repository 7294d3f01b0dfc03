"""Placement decisions: ask the recommender (locojax.placement) and keep what it said.

A decision stores the request, every option the cost model priced, the choice and its one-sentence
reason, priced with the hardware's active calibration (`services.calibration`), which it names. Runs
that follow it carry its id; when such a run finishes, `runs.transition` writes the run's measured
median step time back here beside the prediction.
"""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from locojax.contract import validation_message
from server.errors import InvalidInputError, NotFoundError, UnavailableError
from server.models import PlacementDecision
from server.schemas import PlacementRecommendRequest
from server.services import calibration as calibration_service
from server.services import pagination
from server.services.jsonable import jsonable


def _library():
    try:
        import locojax.placement as placement

        return placement.PlacementRequest, placement.recommend, placement.HARDWARE, placement.WORKLOADS
    except (ImportError, AttributeError) as exc:
        raise UnavailableError(f"the placement library is not available: {exc}", code="PLACEMENT_UNAVAILABLE") from None


def _check_names(body: PlacementRecommendRequest, hardware_registry, workload_registry) -> None:
    from locojax.model.config import PRESETS

    errors = []
    if body.model.lower() not in PRESETS:
        errors.append({"field": "model", "message": f"unknown model {body.model!r}; known: {', '.join(PRESETS)}"})
    if body.hardware not in hardware_registry:
        errors.append({"field": "hardware", "message": f"unknown hardware {body.hardware!r}; "
                                                       f"known: {', '.join(hardware_registry.names())}"})
    if body.workload not in workload_registry:
        errors.append({"field": "workload", "message": f"unknown workload {body.workload!r}; "
                                                       f"known: {', '.join(workload_registry.names())}"})
    if errors:
        raise InvalidInputError(f"{errors[0]['field']}: {errors[0]['message']}", code="PLACEMENT_INVALID",
                                details=errors)


def recommend(session: Session, body: PlacementRecommendRequest, *, created_by: str | None) -> PlacementDecision:
    request_cls, recommend_fn, hardware_registry, workload_registry = _library()
    _check_names(body, hardware_registry, workload_registry)
    fields = body.model_dump(exclude_none=True)
    fields["model"] = body.model.lower()
    # The hardware's active calibration (refitted first when observations arrived since it was fitted).
    profile, calibration = calibration_service.profile_for(session, body.hardware, refit_if_stale=True, by=created_by)
    try:
        recommendation = recommend_fn(request_cls(**fields), profile)
    except ValidationError as exc:  # the library's own request model refused a combination
        details = [{"field": ".".join(str(part) for part in error["loc"]),
                    "message": validation_message(error)} for error in exc.errors()]
        first = details[0] if details else {"field": "", "message": str(exc)}
        raise InvalidInputError(f"{first['field'] or 'request'}: {first['message']}", code="PLACEMENT_INVALID",
                                details=details) from None
    except (ValueError, KeyError) as exc:
        # The library's contract: bad input (e.g. more chips per host than the hardware has) is a
        # ValueError whose message says what is wrong.
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise InvalidInputError(str(message), code="PLACEMENT_INVALID",
                                details=[{"field": "", "message": str(message)}]) from None
    choice = recommendation.choice
    decision = PlacementDecision(
        created_by=created_by, request=body.model_dump(mode="json"),
        options=[jsonable(option) for option in recommendation.options], choice=jsonable(choice),
        reason=str(recommendation.reason), mode=str(jsonable(choice.mode)), predicted_step_s=float(choice.step_time_s),
        calibration_id=calibration.id if calibration is not None else None,
    )
    session.add(decision)
    session.commit()
    return decision


def get(session: Session, decision_id: int) -> PlacementDecision:
    decision = session.get(PlacementDecision, decision_id)
    if decision is None:
        raise NotFoundError(f"placement decision {decision_id} not found", code="DECISION_NOT_FOUND")
    return decision


def list_page(session: Session, *, limit: int, cursor: str | None) -> tuple[list[PlacementDecision], str | None]:
    return pagination.page(session, select(PlacementDecision), PlacementDecision.id, limit=limit, cursor=cursor)
