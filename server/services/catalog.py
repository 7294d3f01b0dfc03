"""What a run can be made of: model presets, hardware profiles, workloads, tasks, rewards, the RunSpec schema.

The engine's registries are imported when asked for, so the API starts even while an optional part of
the engine fails to import, and that failure is reported on the one endpoint that needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

from server.errors import UnavailableError
from server.schemas import CatalogEntry, CatalogModel
from server.services.jsonable import jsonable


def _load(module_name: str, attribute: str) -> Any:
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise UnavailableError(f"{module_name}.{attribute} is not available: {exc}", code="CATALOG_UNAVAILABLE") from None


def models() -> list[CatalogModel]:
    from locojax.model.config import PRESETS, param_count

    return [
        CatalogModel(name=name, arch=config.arch, params=param_count(config), d_model=config.d_model,
                     n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                     head_dim=config.head_dim, d_ff=config.d_ff, vocab_size=config.vocab_size,
                     max_seq_len=config.max_seq_len)
        for name, config in PRESETS.items()
    ]


def _registry_entries(module_name: str, attribute: str) -> list[CatalogEntry]:
    registry = _load(module_name, attribute)
    entries = []
    for name in registry.names():
        attributes = jsonable(registry.get(name))
        entries.append(CatalogEntry(name=name, attributes=attributes if isinstance(attributes, dict) else {}))
    return entries


def hardware() -> list[CatalogEntry]:
    return _registry_entries("locojax.placement", "HARDWARE")


def workloads() -> list[CatalogEntry]:
    return _registry_entries("locojax.placement", "WORKLOADS")


def tasks() -> list[str]:
    return list(_load("locojax.tasks", "TASKS").names())


def rewards() -> list[str]:
    return list(_load("locojax.rewards", "REWARDS").names())


def spec_schema() -> dict[str, Any]:
    from locojax.spec import RunSpec

    return RunSpec.model_json_schema()
