"""Reward functions, registered by name, and `score`, which runs them on host CPU threads.

Every reward is `fn(completion: str, example: Example) -> float`. Registered names:
  gsm8k           strict: the number after `#### ` equals the answer
  gsm8k_flexible  the last number in the completion equals the answer
  math            the last `\\boxed{}` is equivalent to the answer (math-verify, string fallback)
  countdown       the `<answer>` equation uses given numbers at most once and hits the target
  format          the task's answer format is present

A reward that raises (or returns NaN) scores 0 for that sample and is logged once per function:
a scoring bug must not stop a long run, but it must not go unseen either.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
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


def resolve_reward(name: str) -> RewardFn:
    """A registered reward, or a user function named `package.module:function` (importable on every
    host), the way verl and TRL take custom reward functions."""
    if ":" not in name:
        return REWARDS.get(name)
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

    if pool is None:
        results = [_score_chunk(name, completions[start:stop], examples[start:stop]) for name, start, stop in jobs]
    else:
        futures = [pool.submit(_score_chunk, name, list(completions[start:stop]), list(examples[start:stop]))
                   for name, start, stop in jobs]
        results = [future.result() for future in futures]

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


__all__ = ["REWARDS", "RewardFn", "score", "gsm8k_strict", "gsm8k_flexible", "math_reward", "countdown",
           "format_reward"]
