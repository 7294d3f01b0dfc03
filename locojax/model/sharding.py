"""Mesh construction and the one table that maps logical axis names onto mesh axes.

Modules only name logical axes (`embed`, `heads`, `mlp`, ...) in each parameter's `axes` metadata;
`LOGICAL_RULES` decides where they live on a (`data`, `fsdp`, `tensor`) mesh. The same code runs on
local devices (a host's own chips) and on the global devices of a `jax.distributed` job.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "length": None,
    "layers": None,  # the stacked decoder layers' leading axis: every device holds all layers' shards
}


def make_mesh(devices: Sequence[jax.Device] | None = None, fsdp: int = 1, tensor: int = 1) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all global devices); data takes the rest.

    Axis types are Auto: with the default Explicit types, contractions over sharded dimensions raise
    `ShardingTypeError` in this JAX version (PITFALLS.md).
    """
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) % (fsdp * tensor):
        raise ValueError(f"{len(devices)} devices do not divide into fsdp={fsdp} x tensor={tensor}")
    data = len(devices) // (fsdp * tensor)
    grid = np.array(devices, dtype=object).reshape(data, fsdp, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES) -> PartitionSpec:
    """PartitionSpec for an array with logical `axes`; a dimension that the mesh axes do not divide
    evenly (e.g. 4 kv heads on 8-way tensor parallelism) is replicated instead of failing."""
    spec: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for name, size in zip(axes, shape):
        target = rules.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(a for a in mesh_axes if a not in used and mesh.shape[a] > 1)
        ways = math.prod(mesh.shape[a] for a in mesh_axes)
        if not mesh_axes or size % ways:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, mesh: Mesh,
                    rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES) -> nnx.State:
    """A NamedSharding per variable of `state`, from its `axes` metadata (replicated if it has none)."""

    def sharding_of(variable: nnx.Variable):
        axes = variable.get_metadata().get("axes")
        value = variable.get_value()  # an array, or a ShapeDtypeStruct of an abstract state
        spec = logical_to_spec(axes, value.shape, mesh, rules) if axes else PartitionSpec()
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(sharding_of, state, is_leaf=_is_variable)


def shard_state(state: nnx.State, mesh: Mesh,
                rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES) -> nnx.State:
    """Place every variable of `state` according to the rules table."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Batch-first arrays: the leading axis on the `batch` rule, the rest replicated."""
    batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    return NamedSharding(mesh, PartitionSpec(batch_axes, *([None] * (ndim - 1))))
