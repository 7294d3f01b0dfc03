"""/api/v1/catalog: models, hardware profiles, workloads, tasks, rewards, and the RunSpec JSON Schema."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.api.deps import API_PREFIX, ReadToken, errors
from server.schemas import CatalogEntries, CatalogModels, CatalogNames
from server.services import catalog

router = APIRouter(prefix=f"{API_PREFIX}/catalog", tags=["catalog"], responses=errors(401, 503))


@router.get("/models", response_model=CatalogModels)
def models(_: ReadToken) -> CatalogModels:
    return CatalogModels(data=catalog.models())


@router.get("/hardware", response_model=CatalogEntries)
def hardware(_: ReadToken) -> CatalogEntries:
    return CatalogEntries(data=catalog.hardware())


@router.get("/workloads", response_model=CatalogEntries)
def workloads(_: ReadToken) -> CatalogEntries:
    return CatalogEntries(data=catalog.workloads())


@router.get("/tasks", response_model=CatalogNames)
def tasks(_: ReadToken) -> CatalogNames:
    return CatalogNames(data=catalog.tasks())


@router.get("/rewards", response_model=CatalogNames)
def rewards(_: ReadToken) -> CatalogNames:
    return CatalogNames(data=catalog.rewards())


@router.get("/spec-schema", response_model=dict[str, Any])
def spec_schema(_: ReadToken) -> dict[str, Any]:
    """The JSON Schema of a RunSpec (the `spec` of POST /api/v1/runs)."""
    return catalog.spec_schema()
