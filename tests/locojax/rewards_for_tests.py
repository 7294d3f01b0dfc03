"""Reward functions for tests, named as `tests.locojax.rewards_for_tests:<fn>` in specs so that host
subprocesses import them too. A random tiny model never earns a task reward; these give every
completion a different score, so GRPO steps really move the params."""

import threading
import time

_sleep_lock = threading.Lock()
SLEEP_PER_BATCH_S = 0.05
BATCH = 16  # rows per step in tests.locojax.test_co.tiny_spec


def digit_fraction(completion: str, example) -> float:
    """Share of digits among the completion's characters (dense, so advantages are non-zero)."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def sleep_50ms_per_batch(completion: str, example) -> float:
    # 50 ms per batch in total, serialised so the reward thread pool cannot hide it.
    with _sleep_lock:
        time.sleep(SLEEP_PER_BATCH_S / BATCH)
    return 0.0


def sleep_100ms_per_tiny_step(completion: str, example) -> float:
    """Holds a step of tests.e2e.helpers.tiny_spec (8 completions) for at least 100 ms, so a scenario
    that needs a run still training some seconds later does not depend on how fast this machine is."""
    with _sleep_lock:
        time.sleep(0.1 / 8)
    return 0.0


def even_length(completion: str, example) -> float:
    """Full credit for a completion of even length: about half of a random model's, so evaluation
    tests see accuracies strictly between 0 and 1 (a task reward would give a random model 0)."""
    return 1.0 if len(completion) % 2 == 0 else 0.0
