"""/api/v1/calibration: what the placement model learned from measured runs. Observations (runs that
finished here, or imported run directories) and the per-hardware calibration versions fitted on them.

Anyone with a token reads them. Importing, excluding or including an observation and making a version
active are admin-only: a calibration is shared by every user's recommendations and every run's
prediction on that hardware, so a submit token (which may change only its own runs) may not move it;
measurements from elsewhere arrive through an admin, who vouches for them.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response, status

from server.api.deps import API_PREFIX, MAX_INT32, AdminToken, ReadToken, SessionDep, SettingsDep, errors
from server.models import CalibrationObservation
from server.schemas import (
    CalibrationPublic,
    CalibrationsPublic,
    ObservationImport,
    ObservationImported,
    ObservationPublic,
    ObservationsPublic,
)
from server.services import calibration as calibration_service

router = APIRouter(prefix=f"{API_PREFIX}/calibration", tags=["calibration"], responses=errors(401, 403, 422))

ObservationId = Annotated[int, Path(ge=1, le=MAX_INT32)]
CalibrationId = Annotated[int, Path(ge=1, le=MAX_INT32)]
HardwareQuery = Annotated[str | None, Query(min_length=1, max_length=64, description="a hardware profile name")]


def observation_public(row: CalibrationObservation) -> ObservationPublic:
    public = ObservationPublic.model_validate(row)
    return public.model_copy(update={"rel_error": calibration_service.relative_error(row)})


@router.post("/observations", response_model=ObservationImported, status_code=status.HTTP_201_CREATED,
             responses={200: {"model": ObservationImported, "description": "imported before: the same observation"}})
def import_observation(body: ObservationImport, response: Response, session: SessionDep,
                       token: AdminToken) -> ObservationImported:
    """Add a run measured elsewhere (a `locojax train` run directory, as `locojax calibration import`
    reads it); its hardware's calibration is refitted with it. 200 with `created: false` when the same
    run directory (its digest) was imported before."""
    row, created = calibration_service.import_observation(session, body, by=token.name)
    if not created:
        response.status_code = status.HTTP_200_OK
    _, calibration = calibration_service.profile_for(session, row.hardware, refit_if_stale=True, by=token.name)
    return ObservationImported(observation=observation_public(row), created=created,
                               calibration=CalibrationPublic.model_validate(calibration) if calibration else None)


@router.get("/observations", response_model=ObservationsPublic)
def list_observations(session: SessionDep, settings: SettingsDep, _: ReadToken, hardware: HardwareQuery = None,
                      cursor: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
                      limit: Annotated[int | None, Query(ge=1, le=MAX_INT32)] = None) -> ObservationsPublic:
    page_size = min(limit or settings.page_size_default, settings.page_size_max)
    rows, next_cursor = calibration_service.list_observations(session, hardware=hardware, limit=page_size,
                                                              cursor=cursor)
    return ObservationsPublic(data=[observation_public(row) for row in rows], next_cursor=next_cursor)


@router.get("/observations/{observation_id}", response_model=ObservationPublic, responses=errors(404))
def get_observation(observation_id: ObservationId, session: SessionDep, _: ReadToken) -> ObservationPublic:
    return observation_public(calibration_service.get_observation(session, observation_id))


@router.post("/observations/{observation_id}/exclude", response_model=ObservationPublic, responses=errors(404))
def exclude_observation(observation_id: ObservationId, session: SessionDep, token: AdminToken) -> ObservationPublic:
    """Leave an observation out of its hardware's fits (a broken measurement); the next fit follows."""
    return observation_public(calibration_service.set_excluded(session, observation_id, True, by=token.name))


@router.post("/observations/{observation_id}/include", response_model=ObservationPublic, responses=errors(404))
def include_observation(observation_id: ObservationId, session: SessionDep, token: AdminToken) -> ObservationPublic:
    return observation_public(calibration_service.set_excluded(session, observation_id, False, by=token.name))


@router.get("/versions", response_model=CalibrationsPublic)
def list_versions(session: SessionDep, _: ReadToken, hardware: HardwareQuery = None) -> CalibrationsPublic:
    """Every version, newest first per hardware; `active` marks the one in use."""
    return CalibrationsPublic(data=[CalibrationPublic.model_validate(row)
                                    for row in calibration_service.list_versions(session, hardware)])


@router.get("/versions/{calibration_id}", response_model=CalibrationPublic, responses=errors(404))
def get_version(calibration_id: CalibrationId, session: SessionDep, _: ReadToken) -> CalibrationPublic:
    return CalibrationPublic.model_validate(calibration_service.get_version(session, calibration_id))


@router.post("/versions/{calibration_id}/activate", response_model=CalibrationPublic, responses=errors(404))
def activate_version(calibration_id: CalibrationId, session: SessionDep, token: AdminToken) -> CalibrationPublic:
    """Return to this version: recommendations and run predictions on its hardware use it until an
    observation of that hardware next arrives or changes (then a new version is fitted)."""
    return CalibrationPublic.model_validate(calibration_service.activate(session, calibration_id, by=token.name))
