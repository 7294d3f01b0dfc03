"""What every task shares: the `Example` record, the `Task` protocol, and deterministic batching.

A task is an indexable collection of examples (generated ones compute example i from i alone).
Which examples make up step t's batch is a pure function of (seed, step): each epoch is a fresh
permutation of the task, so examples are seen once per epoch and a restarted run sees exactly the
batches it would have seen. Host h's shard is a contiguous slice of that batch, so
the H shards are disjoint and their union, in host order, is the global batch (DESIGN §5 step 1):
no host ever needs to talk to another to know its prompts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt and what its rewards need.

    prompt:    the formatted text fed to the model (the task's template applied).
    reference: a correct completion in the task's answer format (teacher forcing for SFT).
    answer:    the ground truth a reward compares against (a number, a LaTeX expression, a target).
    meta:      task-specific extras for rewards (`answer_format`, countdown's `numbers`, ...).
    """

    uid: str
    prompt: str
    reference: str
    answer: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)


# Names of the answer formats the `format` reward checks; tasks put one in `meta["answer_format"]`.
GSM8K_FORMAT = "gsm8k"  # a final line `#### N`
BOXED_FORMAT = "boxed"  # a `\boxed{...}` answer
ANSWER_TAG_FORMAT = "answer_tag"  # `<answer>...</answer>`


@runtime_checkable
class Task(Protocol):
    name: str
    default_rewards: tuple[str, ...]

    def __len__(self) -> int: ...

    def example(self, index: int) -> Example: ...


class GeneratedTask:
    """A task whose example i is a pure function of (difficulty, i): nothing is stored, any index
    works, and `size` only sets the epoch length. Subclasses set `name`, `default_rewards`,
    `levels` and `make_example`."""

    name: str
    default_rewards: tuple[str, ...]
    levels: dict
    nominal_size = 1_000_000

    def __init__(self, difficulty: int = 1, size: int | None = None):
        if difficulty not in self.levels:
            raise ValueError(f"{self.name} difficulty must be one of {sorted(self.levels)}, got {difficulty}")
        self.difficulty = difficulty
        self.size = self.nominal_size if size is None else size

    def __len__(self) -> int:
        return self.size

    def example(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name} index {index} out of range [0, {self.size})")
        return self.make_example(self.difficulty, index)

    @staticmethod
    def make_example(difficulty: int, index: int) -> Example:
        raise NotImplementedError


class DataFormatError(ValueError):
    """A local data file that does not have the shape its task expects; names file, line and field."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str, unit: str = "line"):
        self.path, self.line, self.field = str(path), line, field
        where = f"{path}, {unit} {line}" if line is not None else str(path)
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{where}: {what}{message}")


@functools.lru_cache(maxsize=8)
def _epoch_permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    # Seeded by (seed, epoch) so epochs differ and runs with different seeds see different orders.
    # Cached: consecutive steps of one epoch reuse it (a permutation of 1M indices is ~15 ms).
    permutation = np.random.default_rng([seed, epoch, 0x10C0]).permutation(size)
    permutation.setflags(write=False)
    return permutation


def batch_indices(size: int, seed: int, step: int, prompts_per_step: int) -> np.ndarray:
    """Task indices of step `step`'s global batch: [prompts_per_step] int64.

    Each epoch is a fresh permutation cut into whole batches (the last `size % prompts_per_step`
    indices of an epoch are dropped, different ones each epoch), so a batch never holds an example
    twice. A task smaller than one batch wraps through as many epochs as it takes.
    """
    if size <= 0:
        raise ValueError("the task has no examples")
    if step < 0 or prompts_per_step <= 0:
        raise ValueError(f"need step >= 0 and prompts_per_step > 0, got {step}, {prompts_per_step}")
    if size >= prompts_per_step:
        steps_per_epoch = size // prompts_per_step
        epoch, start = divmod(step, steps_per_epoch)
        start *= prompts_per_step
        return _epoch_permutation(size, seed, epoch)[start:start + prompts_per_step].astype(np.int64)
    stream = step * prompts_per_step + np.arange(prompts_per_step, dtype=np.int64)  # positions in the stream
    epochs, offsets = np.divmod(stream, size)
    out = np.empty(prompts_per_step, dtype=np.int64)
    for epoch in np.unique(epochs):
        where = epochs == epoch
        out[where] = _epoch_permutation(size, seed, int(epoch))[offsets[where]]
    return out


def global_batch(task: Task, seed: int, step: int, prompts_per_step: int) -> list[Example]:
    """The `prompts_per_step` examples of step `step`, the same on every host and every restart."""
    return [task.example(int(i)) for i in batch_indices(len(task), seed, step, prompts_per_step)]


def host_shard(task: Task, seed: int, step: int, prompts_per_step: int, host: int, num_hosts: int) -> list[Example]:
    """Host `host`'s contiguous slice of the global batch; only its own examples are materialised."""
    if num_hosts <= 0 or not 0 <= host < num_hosts:
        raise ValueError(f"host must be in [0, {num_hosts}), got {host}")
    if prompts_per_step % num_hosts:
        raise ValueError(
            f"prompts_per_step ({prompts_per_step}) must be divisible by num_hosts ({num_hosts}) "
            "so every host gets whole groups"
        )
    per_host = prompts_per_step // num_hosts
    indices = batch_indices(len(task), seed, step, prompts_per_step)[host * per_host:(host + 1) * per_host]
    return [task.example(int(i)) for i in indices]


def repeat_examples(examples: Sequence[Example], group_size: int) -> list[Example]:
    """Each example `group_size` times in a row: the layout of a GRPO batch, one group per prompt."""
    return [example for example in examples for _ in range(group_size)]


def read_records(path: str, fields: Sequence[str]) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    """Rows of a local JSONL (or `.parquet`) file as (line or row number, record), and the unit name.

    Checks only what every file task needs: the file exists, each line is a JSON object, and every
    named field is a non-empty string. Errors name the file, line (or parquet row) and field.
    """
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise DataFormatError(path, None, None, "file not found")
    if file.suffix == ".parquet":
        records, unit = _parquet_records(file, fields), "row"
    else:
        records, unit = _jsonl_records(file), "line"
    for number, record in records:
        for field in fields:
            value = record.get(field)
            if value is None:
                raise DataFormatError(path, number, field, "missing", unit)
            if not isinstance(value, str):
                raise DataFormatError(path, number, field, f"must be a string, got {type(value).__name__}", unit)
            if not value.strip():
                raise DataFormatError(path, number, field, "is empty", unit)
    if not records:
        raise DataFormatError(path, None, None, "has no records")
    return records, unit


def _jsonl_records(file) -> list[tuple[int, dict[str, Any]]]:
    import json

    records = []
    with open(file, encoding="utf-8") as handle:
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue  # blank lines (a trailing newline, say) are not records
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataFormatError(str(file), number, None, f"not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise DataFormatError(str(file), number, None,
                                          f"expected a JSON object, got {type(record).__name__}")
                records.append((number, record))
        except UnicodeDecodeError as exc:
            raise DataFormatError(str(file), None, None, f"not UTF-8 text ({exc.reason})") from None
    return records


def _parquet_records(file, fields: Sequence[str]) -> list[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataFormatError(str(file), None, None, f"not a readable parquet file ({exc})") from None
    for field in fields:
        if field not in table.column_names:
            raise DataFormatError(str(file), None, field,
                                  f"missing column (columns: {', '.join(table.column_names)})")
    columns = {field: table.column(field).to_pylist() for field in fields}
    # Rows numbered from 1 like lines, so an error message reads the same for both formats.
    return [(row + 1, {field: columns[field][row] for field in fields}) for row in range(table.num_rows)]
