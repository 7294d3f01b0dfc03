"""Checkpoints: asynchronous Orbax saves of the `TrainState` plus JSON metadata, exact resume.

With LoRA, `TrainState.params` are the adapters and the frozen base weights are not part of a checkpoint
(the run rebuilds them from its spec), so a checkpoint holds adapters and their optimizer state alone.

One checkpoint per saved step, named by the number of train steps completed (`state.step`), holds
three Orbax items:
    params  the policy parameters as a pure nested dict of arrays (the `to_pure_dict()` layout,
            keys as strings) — what `load_params` reads to warm-start another run (SFT -> GRPO)
    train   {"step", "opt_state", "rng"}: the rest of the TrainState, also pure dicts of arrays
    extra   JSON: {"step": ..., plus the caller's data position / run metadata}
Pure dicts, not nnx.State objects, are saved (PITFALLS): restore walks the caller's template state
and puts every array back in the template's tree, dtype and sharding, so a restore is bit-exact.

Saves are asynchronous: `save` returns once the arrays are copied off the devices (so the next,
donating, train step may overwrite them) and writes in the background; `wait_until_finished` and
`close` block. In a `jax.distributed` job every process calls `save` and `restore` with its own
addressable shards; Orbax coordinates the processes and the primary writes the metadata.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from locojax.train import TrainState

_ITEMS = ("params", "train", "extra")


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    raise TypeError(f"unsupported pytree path entry {entry!r}")


def _leaf_paths(tree: Any) -> tuple[list[tuple[str, ...]], list[Any], Any]:
    """(paths, leaves, treedef) with each path as string keys. A Variable's trailing `.value` is
    dropped so params look like `nnx.State.to_pure_dict()`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths, leaves = [], []
    for path, leaf in flat:
        if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
            path = path[:-1]
        paths.append(tuple(_key_name(p) for p in path))
        leaves.append(leaf)
    if len(set(paths)) != len(paths):
        raise ValueError("two leaves of the state map to the same checkpoint path")
    return paths, leaves, treedef


def to_pure_dict(tree: Any) -> dict:
    """A pytree as nested dicts with string keys and array leaves (no Variables, namedtuples, tuples)."""
    paths, leaves, _ = _leaf_paths(tree)
    out: dict = {}
    for path, leaf in zip(paths, leaves):
        if not path:
            raise ValueError("a bare array cannot be a checkpoint item; wrap it in a dict")
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def from_pure_dict(pure: Mapping, template: Any) -> Any:
    """Inverse of `to_pure_dict`: the template's tree with leaves read from `pure` by path."""
    paths, _, treedef = _leaf_paths(template)
    leaves = []
    for path in paths:
        node: Any = pure
        for key in path:
            node = node[key]
        leaves.append(node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs carrying the template's shardings (replicated over all devices if it has none)."""
    def one(leaf):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            sharding = NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def _host_int(x: Any) -> int:
    """An int from a scalar that may be a replicated, not fully addressable global array."""
    if isinstance(x, jax.Array):
        x = x.addressable_data(0)
    return int(np.asarray(x))


def _manager(directory: str | Path, keep: int | None, async_save: bool, read_only: bool = False):
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=not read_only, read_only=read_only)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=_ITEMS)


class Checkpointer:
    """Saves every `every` train steps (0: only when forced), keeps the newest `keep`, restores exactly.

        ckpt = Checkpointer(dir, every=25, keep=3)
        restored = ckpt.restore_latest(fresh_state)          # None on a fresh directory
        state, extra = restored if restored else (fresh_state, {})
        for ...:
            state, stats = train_step(state, batch)
            ckpt.save(state, {"run_name": name})             # saves only when state.step % every == 0
        ckpt.save(state, force=True); ckpt.close()
    """

    def __init__(self, directory: str | Path, *, every: int = 0, keep: int = 3, async_save: bool = True):
        if every < 0 or keep < 1:
            raise ValueError(f"need every >= 0 and keep >= 1, got every={every}, keep={keep}")
        self.directory = Path(directory)
        self.every = every
        self._manager = _manager(directory, keep, async_save)

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(self, state: TrainState, extra: Mapping[str, Any] | None = None, *, force: bool = False) -> bool:
        """Save `state` under `state.step` if due (or `force`); `extra` must be JSON-serialisable.
        Returns whether a save started. A step already saved is not saved again."""
        if not force and self.every <= 0:
            return False  # never due: no need to read the step counter off the device
        step = _host_int(state.step)
        if not (force or self.should_save(step)) or step in self._manager.all_steps():
            return False
        train = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(to_pure_dict(state.params)),
            train=ocp.args.StandardSave(to_pure_dict(train)),
            extra=ocp.args.JsonSave({**dict(extra or {}), "step": step}),
        )
        return bool(self._manager.save(step, args=args, force=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def step_bytes(self, step: int) -> int:
        """Bytes on disk of the checkpoint of `step` (every file under its directory)."""
        self._manager.wait_until_finished()
        return directory_bytes(self.directory / str(step))

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """The state saved at `step` (default: latest) in the template's structure, dtypes and
        shardings, and its extra metadata."""
        self._manager.wait_until_finished()  # a save in flight is not yet visible
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        train_template = {"step": template.step, "opt_state": template.opt_state, "rng": template.rng}
        restored = self._manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(to_pure_dict(template.params))),
            train=ocp.args.StandardRestore(_abstract(to_pure_dict(train_template))),
            extra=ocp.args.JsonRestore(),
        ))
        params = from_pure_dict(restored["params"], template.params)
        train = from_pure_dict(restored["train"], train_template)
        # With LoRA, `params` are the adapters alone; the frozen weights are the template's (never saved).
        state = TrainState(step=train["step"], params=params, opt_state=train["opt_state"], rng=train["rng"],
                           frozen=template.frozen)
        return state, dict(restored["extra"] or {})

    def restore_latest(self, template: TrainState) -> tuple[TrainState, dict[str, Any]] | None:
        """`restore(template)` of the newest checkpoint, or None when there is none (a fresh run)."""
        self._manager.wait_until_finished()
        if self.latest_step() is None:
            return None
        return self.restore(template)

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release Orbax's threads."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def directory_bytes(directory: str | Path) -> int:
    """Total size of the files under `directory` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def load_params(directory: str | Path, template_params: Any, step: int | None = None) -> Any:
    """Only the params of a checkpoint (default: latest), in the template's tree and shardings; for
    warm-starting a run from another run's checkpoint (e.g. GRPO from SFT)."""
    manager = _manager(directory, None, async_save=False, read_only=True)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(to_pure_dict(template_params)))))
        return from_pure_dict(restored["params"], template_params)
    finally:
        manager.close()


__all__ = ["Checkpointer", "directory_bytes", "from_pure_dict", "load_params", "to_pure_dict"]
