"""The held-out split: the evaluation prompts of a run, and the training view that never shows them.

Held out by construction, then by text:
* generated tasks (arith, countdown): evaluation examples come from indices past the training range
  (`len(task)` onwards), which training never draws;
* file tasks (gsm8k, math): `eval.path`'s records when given (e.g. GSM8K's test split), else a
  seeded share of `task.path`'s records, removed from the training view.
Distinct indices or records can still carry the same prompt text (arith difficulty 0 has ~10^4
distinct equations behind 10^6 indices; GSM8K-style files repeat questions), so in both cases the
training view also skips every example whose prompt is a held-out prompt. The split depends on
the task and the eval block only, not on the run's seed: runs with different seeds are evaluated
on the same prompts.

`locojax.tasks.load_task_data` builds a run's task and splits it here.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from locojax.spec import EvalSpec
from locojax.tasks.base import Example, GeneratedTask, Task

# Fixed, so every run of a task holds out the same records (seed-independent, see the docstring).
SPLIT_SEED = 0xE7A1
# Generated tasks: how many indices past the training range to scan for distinct held-out prompts,
# per prompt wanted (arith difficulty 0 repeats an equation about once per 10^4 indices).
SCAN_PER_PROMPT = 64
# A training index whose prompt is held out is replaced by the next one that is not; this bounds
# the walk (a task almost all of whose prompts are held out is a configuration error).
MAX_SKIPS = 1024


@dataclasses.dataclass(frozen=True)
class TaskData:
    """What a run reads from its task: the examples it trains on and the ones it evaluates on."""

    train: Task
    held_out: tuple[Example, ...] = ()


class GeneratedTrainView:
    """A generated task without the held-out prompts: example i is the task's example i, or, when
    that prompt is held out, the first of i+1, i+2, ... (cyclically) whose prompt is not."""

    def __init__(self, task: GeneratedTask, held_out_prompts: frozenset[str]):
        self.task, self.held_out_prompts = task, held_out_prompts
        self.name, self.default_rewards = task.name, task.default_rewards

    def __len__(self) -> int:
        return len(self.task)

    def example(self, index: int) -> Example:
        for skip in range(MAX_SKIPS):
            example = self.task.example((index + skip) % len(self.task))
            if example.prompt not in self.held_out_prompts:
                return example
        raise ValueError(f"{self.task.name}: {MAX_SKIPS} consecutive training examples from index {index} are "
                         "all held out; use fewer eval.prompts")


class FileTrainView:
    """A file task restricted to the records whose prompts are not held out (renumbered 0..n-1, so
    epochs are permutations of the kept records and a batch never repeats one)."""

    def __init__(self, task: Task, kept: Sequence[int]):
        self.task, self.kept = task, np.asarray(kept, np.int64)
        self.name, self.default_rewards = task.name, task.default_rewards

    def __len__(self) -> int:
        return len(self.kept)

    def example(self, index: int) -> Example:
        return self.task.example(int(self.kept[index]))


def _distinct(examples, count: int) -> tuple[Example, ...]:
    """The first `count` examples with distinct prompts."""
    seen: dict[str, Example] = {}
    for example in examples:
        seen.setdefault(example.prompt, example)
        if len(seen) == count:
            break
    return tuple(seen.values())


def _generated_split(task: GeneratedTask, eval_spec: EvalSpec) -> TaskData:
    start = len(task)  # the first index training never draws
    candidates = (task.make_example(task.difficulty, start + offset)
                  for offset in range(eval_spec.prompts * SCAN_PER_PROMPT))
    held_out = _distinct(candidates, eval_spec.prompts)
    if len(held_out) < eval_spec.prompts:
        raise ValueError(f"{task.name} difficulty {task.difficulty} has only {len(held_out)} distinct "
                         f"prompts in {eval_spec.prompts * SCAN_PER_PROMPT} held-out indices; ask for fewer")
    return TaskData(GeneratedTrainView(task, frozenset(e.prompt for e in held_out)), held_out)


def _file_split(task: Task, eval_spec: EvalSpec, eval_task: Task | None) -> TaskData:
    if eval_task is not None:
        held_out = _distinct((eval_task.example(i) for i in range(len(eval_task))), eval_spec.prompts)
    else:
        order = np.random.default_rng(SPLIT_SEED).permutation(len(task))
        held_out = _distinct((task.example(int(i)) for i in order), eval_spec.prompts)
    prompts = frozenset(e.prompt for e in held_out)
    kept = [i for i in range(len(task)) if task.example(i).prompt not in prompts]
    if not kept:
        raise ValueError(f"{eval_spec.prompts} held-out prompts are every record of task.path "
                         f"({len(task)} records); ask for fewer or give eval.path")
    return TaskData(FileTrainView(task, kept), held_out)


def held_out_split(task: Task, eval_spec: EvalSpec, eval_task: Task | None = None) -> TaskData:
    """Split `task` into a training view and `eval_spec.prompts` held-out examples (fewer when
    `eval_task`, the file `eval.path` names, has fewer distinct prompts)."""
    if isinstance(task, GeneratedTask):
        return _generated_split(task, eval_spec)
    return _file_split(task, eval_spec, eval_task)


def host_slice(examples: Sequence[Example], host: int, num_hosts: int) -> tuple[int, list[Example]]:
    """Host `host`'s contiguous shard of the held-out examples and the index of its first one (the
    shards are disjoint and, in host order, make up the whole list)."""
    per_host, extra = divmod(len(examples), num_hosts)
    start = host * per_host + min(host, extra)
    stop = start + per_host + (1 if host < extra else 0)
    return start, list(examples[start:stop])
