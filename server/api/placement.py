"""/api/v1/placement: ask the recommender (stored as a decision), list and read decisions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from server.api.deps import API_PREFIX, MAX_INT32, ReadToken, SessionDep, SettingsDep, SubmitToken, errors
from server.schemas import DecisionPublic, DecisionsPublic, PlacementRecommendRequest
from server.services import placement as placement_service

router = APIRouter(prefix=f"{API_PREFIX}/placement", tags=["placement"], responses=errors(401, 403, 422))


@router.post("/recommend", status_code=status.HTTP_201_CREATED, response_model=DecisionPublic,
             responses=errors(503))
def recommend(body: PlacementRecommendRequest, session: SessionDep, token: SubmitToken) -> DecisionPublic:
    """Price SC, CO and DA (at each rollout fraction) for this model, hardware and workload; store and
    return the decision. Submit a run with `placement.decision_id` to follow it."""
    return DecisionPublic.model_validate(placement_service.recommend(session, body, created_by=token.name))


@router.get("/decisions", response_model=DecisionsPublic)
def list_decisions(session: SessionDep, settings: SettingsDep, _: ReadToken,
                   cursor: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
                   limit: Annotated[int | None, Query(ge=1, le=MAX_INT32)] = None) -> DecisionsPublic:
    page_size = min(limit or settings.page_size_default, settings.page_size_max)
    rows, next_cursor = placement_service.list_page(session, limit=page_size, cursor=cursor)
    return DecisionsPublic(data=[DecisionPublic.model_validate(row) for row in rows], next_cursor=next_cursor)


@router.get("/decisions/{decision_id}", response_model=DecisionPublic, responses=errors(404))
def get_decision(decision_id: Annotated[int, Path(ge=1, le=MAX_INT32)], session: SessionDep,
                 _: ReadToken) -> DecisionPublic:
    return DecisionPublic.model_validate(placement_service.get(session, decision_id))
