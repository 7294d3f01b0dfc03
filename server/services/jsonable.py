"""Turn library objects (dataclasses, pydantic models, registries' entries) into JSON-safe values.

Non-finite floats become null: JSON has no inf/NaN, and a cost model may price an infeasible option
at inf.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any


def jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if hasattr(value, "to_json") and callable(value.to_json):
        return jsonable(value.to_json())
    if hasattr(value, "model_dump") and callable(value.model_dump):
        return jsonable(value.model_dump(mode="json"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: jsonable(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(item) for item in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return jsonable(value.item())
    return str(value)
