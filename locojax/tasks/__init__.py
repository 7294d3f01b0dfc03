"""Prompt sources, registered by name: `arith`, `countdown` (generated), `gsm8k`, `math` (local files).

`make_task(spec)` builds the task a `TaskSpec` names; `global_batch` / `host_shard` pick step t's
prompts deterministically from (seed, step), host shards being disjoint slices of the global batch.
`load_task_data`, what runs and the API call, builds a run's task with its held-out split
(`locojax.tasks.held_out`) and reports a missing or malformed data file as a `SpecError` naming the
spec field (`task.path`, `eval.path`), so it reads like any spec error.
"""

from __future__ import annotations

from typing import Callable

from locojax.registry import Registry
from locojax.spec import EvalSpec, SpecError, TaskSpec
from locojax.tasks.arith import ArithTask
from locojax.tasks.base import (
    ANSWER_TAG_FORMAT,
    BOXED_FORMAT,
    GSM8K_FORMAT,
    DataFormatError,
    Example,
    Task,
    batch_indices,
    global_batch,
    host_shard,
    repeat_examples,
)
from locojax.tasks.countdown import CountdownTask
from locojax.tasks.gsm8k import GSM8KTask
from locojax.tasks.held_out import TaskData, held_out_split, host_slice
from locojax.tasks.math import MathTask

TASKS: Registry[Callable[[TaskSpec], Task]] = Registry("task")


def _needs_path(spec: TaskSpec) -> str:
    if not spec.path:
        raise ValueError(f"task.path is required for task {spec.name!r} (a local JSONL or parquet file)")
    return spec.path


TASKS.register("arith")(lambda spec: ArithTask(difficulty=spec.difficulty))
TASKS.register("countdown")(lambda spec: CountdownTask(difficulty=spec.difficulty))
TASKS.register("gsm8k")(lambda spec: GSM8KTask(_needs_path(spec)))
TASKS.register("math")(lambda spec: MathTask(_needs_path(spec)))


def make_task(spec: TaskSpec) -> Task:
    """The task `spec.name` names, built from the spec (generated tasks use `spec.difficulty`)."""
    return TASKS.get(spec.name)(spec)


def load_task_data(task_spec: TaskSpec, eval_spec: EvalSpec | None, source: str = "spec") -> TaskData:
    """The run's task, split when it has an eval block; data-file errors as a `SpecError` naming the
    spec field whose file is missing or malformed."""

    def build(field: str, spec: TaskSpec) -> Task:
        try:
            return make_task(spec)
        except DataFormatError as exc:
            raise SpecError([(field, str(exc))], source) from None

    task = build("task.path", task_spec)
    if eval_spec is None:
        return TaskData(task)
    eval_task = build("eval.path", task_spec.model_copy(update={"path": eval_spec.path})) if eval_spec.path else None
    try:
        return held_out_split(task, eval_spec, eval_task)
    except ValueError as exc:
        raise SpecError([("eval.prompts", str(exc))], source) from None


def reward_names(spec: TaskSpec, task: Task) -> tuple[str, ...]:
    """The reward functions a run scores with: the spec's list if given, else the task's defaults."""
    return tuple(spec.reward) if spec.reward else task.default_rewards


__all__ = [
    "TASKS", "Example", "Task", "DataFormatError", "make_task", "reward_names", "global_batch", "host_shard",
    "batch_indices", "repeat_examples", "ArithTask", "CountdownTask", "GSM8KTask", "MathTask",
    "GSM8K_FORMAT", "BOXED_FORMAT", "ANSWER_TAG_FORMAT", "TaskData", "held_out_split", "host_slice",
    "load_task_data",
]
