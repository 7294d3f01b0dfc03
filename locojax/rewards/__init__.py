"""Reward functions, registered by name, and `score`, which runs them on host CPU threads.

Every reward is `fn(completion: str, example: Example) -> float`. Registered names:
  gsm8k           strict: the number after `#### ` equals the answer
  gsm8k_flexible  the last number in the completion equals the answer
  math            the last `\\boxed{}` is equivalent to the answer (math-verify, string fallback)
  countdown       the `<answer>` equation uses given numbers at most once and hits the target
  format          the task's answer format is present

A reward may also be a function named by import path, `package.module:function`, but only when the
module is under a prefix the operator allowed (`LOCOJAX_REWARD_MODULES` on the API and on each worker,
which starts its engine processes with `--reward-modules`): a submitter must not make every host import
and call whatever it names (`builtins:exec`, `shutil:rmtree`). The API checks a spec against the list;
an engine process checks again before it imports anything (`allow_reward_modules`, `resolve_reward`).
Both ask `unknown_names`, which also checks the spec's task name against the task registry.

A reward that raises (or returns NaN) scores 0 for that sample and is logged once per function:
a scoring bug must not stop a long run, but it must not go unseen either.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import re
import threading
import traceback
from math import isfinite  # not `import math`: the `math` submodule shadows it here
from typing import Callable, Sequence

import numpy as np

from locojax.registry import Registry
from locojax.rewards.countdown import countdown
from locojax.rewards.format import format_reward
from locojax.rewards.gsm8k import gsm8k_flexible, gsm8k_strict
from locojax.rewards.math import math_reward
from locojax.spec import RunSpec
from locojax.tasks import TASKS
from locojax.tasks.base import Example

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Example], float]
REWARDS: Registry[RewardFn] = Registry("reward")
REWARDS.register("gsm8k")(gsm8k_strict)
REWARDS.register("gsm8k_flexible")(gsm8k_flexible)
REWARDS.register("math")(math_reward)
REWARDS.register("countdown")(countdown)
REWARDS.register("format")(format_reward)

# Samples per pool task: large enough that submission overhead (~10 us) is noise next to the
# regex work, small enough that a pool of a few threads stays balanced.
CHUNK = 32

_logged_failures: set[str] = set()
_logged_lock = threading.Lock()


def _score_chunk(name: str, completions: Sequence[str], examples: Sequence[Example]) -> tuple[list[float], int, str]:
    """Scores of one chunk, the number of samples that raised, and the first failure's description.

    Module-level (not a closure) so a ProcessPoolExecutor can run it too.
    """
    fn = resolve_reward(name)
    values, failures, first_failure = [], 0, ""
    for completion, example in zip(completions, examples):
        try:
            value = float(fn(completion, example))
            if not isfinite(value):
                raise ValueError(f"non-finite reward {value}")
        except Exception as exc:  # noqa: BLE001 - any reward bug scores 0, see the module docstring
            value = 0.0
            failures += 1
            if not first_failure:
                first_failure = f"example {example.uid}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        values.append(value)
    return values, failures, first_failure


def _log_failure_once(name: str, failures: int, total: int, first_failure: str) -> None:
    with _logged_lock:
        if name in _logged_failures:
            return
        _logged_failures.add(name)
    log.error("reward %r raised on %d of %d samples (scored 0; logged once per function). First: %s",
              name, failures, total, first_failure)


# `package.module:function`: identifiers only, so a name cannot smuggle a path or an expression.
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

# Module prefixes this process may import rewards from; empty until the operator's list is given.
_allowed_prefixes: tuple[str, ...] = ()


def split_prefixes(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """Module prefixes from `a.b,c` (or `a.b:c`, as `Settings.as_environment` joins lists), or a list."""
    if value is None:
        return ()
    parts = re.split(r"[,:\s]+", value) if isinstance(value, str) else [str(part).strip() for part in value]
    return tuple(part for part in parts if part)


def allow_reward_modules(prefixes: str | Sequence[str] | None) -> None:
    """Set this process's allowed reward module prefixes (the operator's list, from the command line)."""
    global _allowed_prefixes
    _allowed_prefixes = split_prefixes(prefixes)


def allowed_reward_modules() -> tuple[str, ...]:
    return _allowed_prefixes


def reward_name_error(name: str, prefixes: Sequence[str]) -> str | None:
    """Why `name` may not be used as a reward under these module prefixes, or None when it may.

    A registered name always may. An import path may when its module is a prefix or below one
    (`tests.locojax` allows `tests.locojax.rewards_for_tests`, not `tests.locojaxx`)."""
    if ":" not in name:
        if name in REWARDS:
            return None
        return f"unknown reward {name!r}; known: {', '.join(REWARDS.names())}, or an allowed package.module:function"
    if not IMPORT_PATH.match(name):
        return f"reward {name!r} is not a package.module:function import path"
    module_name = name.partition(":")[0]
    if any(module_name == prefix or module_name.startswith(prefix + ".") for prefix in prefixes):
        return None
    allowed = ", ".join(prefixes) if prefixes else "none (LOCOJAX_REWARD_MODULES is empty)"
    return f"reward module {module_name!r} is not allowed by the operator; allowed module prefixes: {allowed}"


def check_reward_names(names: Sequence[str], prefixes: Sequence[str]) -> list[tuple[int, str]]:
    """(index, reason) for each name in `names` that may not be used."""
    return [(index, error) for index, name in enumerate(names)
            if (error := reward_name_error(name, prefixes)) is not None]


def unknown_names(spec: RunSpec, reward_modules: Sequence[str]) -> list[tuple[str, str]]:
    """(field path, message) for each task or reward name of `spec` its registry does not hold, or a
    `package.module:function` reward outside the operator's `reward_modules`. The CLI, the hosts
    and the API all ask this, so they refuse the same specs with the same messages. (Mode,
    advantage estimator and loss names are checked by the spec fields' own types, which list
    exactly the registries' names: a test holds them equal.)"""
    errors = []
    if spec.task.name not in TASKS:
        errors.append(("task.name", f"unknown task {spec.task.name!r}; known: {', '.join(TASKS.names())}"))
    rewards = {"task.reward": spec.task.reward or [], "eval.reward": (spec.eval.reward if spec.eval else None) or []}
    errors += [(f"{field}.{index}", message) for field, names in rewards.items()
               for index, message in check_reward_names(names, reward_modules)]
    return errors


def resolve_reward(name: str) -> RewardFn:
    """A registered reward, or a function named `package.module:function` whose module this process
    was allowed to import (`allow_reward_modules`); anything else is refused before any import."""
    if ":" not in name:
        return REWARDS.get(name)
    error = reward_name_error(name, _allowed_prefixes)
    if error is not None:
        raise KeyError(error)
    module_name, _, attribute = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"reward {name!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise KeyError(f"reward {name!r} is not callable")
    return fn


def score(
    reward_names: Sequence[str],
    completions: Sequence[str],
    examples: Sequence[Example],
    pool: concurrent.futures.Executor | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Sum of the named rewards per sample: total [N] float32 and each function's [N] float32.

    `examples[i]` is the example `completions[i]` answers (repeat each example G times for groups).
    With a pool, chunks of samples run as pool tasks; without one, inline. Unknown reward names
    raise KeyError at once: that is a configuration error, not a scoring bug.
    """
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
    for name in reward_names:
        resolve_reward(name)
    n = len(completions)
    chunks = [(start, min(start + CHUNK, n)) for start in range(0, n, CHUNK)]
    jobs = [(name, start, stop) for name in reward_names for start, stop in chunks]

    # The calling thread scores the first chunk (every chunk without a pool) while the pool takes the rest:
    # every hand-over costs (64 gsm8k samples on a TPU host: 0.11 ms through the pool, 0.03 ms inline),
    # and the scores are on the CO step's critical path, the chip waiting for the advantages.
    handed = jobs[1:] if pool is not None else []
    futures = [pool.submit(_score_chunk, name, list(completions[start:stop]), list(examples[start:stop]))
               for name, start, stop in handed]
    results = [_score_chunk(name, completions[start:stop], examples[start:stop])
               for name, start, stop in jobs[:len(jobs) - len(handed)]]
    results += [future.result() for future in futures]

    per_fn = {name: np.zeros(n, np.float32) for name in reward_names}
    failures = {name: [0, ""] for name in reward_names}
    for (name, start, stop), (values, failed, first_failure) in zip(jobs, results):
        per_fn[name][start:stop] = values
        failures[name][0] += failed
        failures[name][1] = failures[name][1] or first_failure
    for name, (failed, first_failure) in failures.items():
        if failed:
            _log_failure_once(name, failed, n, first_failure)
    total = np.zeros(n, np.float32)
    for values in per_fn.values():
        total += values
    return total, per_fn


__all__ = ["REWARDS", "RewardFn", "score", "resolve_reward", "allow_reward_modules", "allowed_reward_modules",
           "check_reward_names", "reward_name_error", "split_prefixes", "unknown_names", "gsm8k_strict", "gsm8k_flexible",
           "math_reward", "countdown", "format_reward"]
