"""MATH / NuminaMath answers: the completion's last `\\boxed{}` is checked for equivalence.

Equivalence is decided by `math-verify` (LaTeX -> sympy, numeric and symbolic comparison), after a
cheap normalised-string comparison that also serves as the fallback when either side cannot be
parsed (a word answer, an unusual macro).

Timeouts: math-verify bounds sympy with SIGALRM, which Python allows only on a process's main
thread. On the main thread (direct calls, or workers of a ProcessPoolExecutor passed to `score`)
the timeout is on; on other threads it is off, and answers are capped at MAX_ANSWER_CHARS instead
so a hostile expression cannot stall a reward thread for long. Long untrusted chain-of-thought
workloads should score through a process pool.
"""

from __future__ import annotations

import re
import threading

from locojax.tasks.base import Example
from locojax.tasks.math import last_boxed

MAX_ANSWER_CHARS = 300
TIMEOUT_S = 5

_REMOVE = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\ ", "$", r"\displaystyle",
           r"^\circ", r"^{\circ}", r"\%", "%", "°")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def normalise(answer: str) -> str:
    """A canonical string for an answer: formatting dropped, spacing removed, `\\dfrac` -> `\\frac`."""
    text = answer.strip()
    text = _TEXT.sub(r"\1", text)
    for token in _REMOVE:
        text = text.replace(token, "")
    text = text.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    text = re.sub(r"\s+", "", text).rstrip(".")
    text = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", text)  # .5 -> 0.5
    if re.fullmatch(r"-?\d+\.0+", text):
        text = text.split(".")[0]  # 3.0 -> 3
    return text


def _math_verify_equal(predicted: str, truth: str) -> bool | None:
    """True/False from math-verify; None when it cannot parse one side."""
    from math_verify import parse, verify

    on_main_thread = threading.current_thread() is threading.main_thread()
    timeout = TIMEOUT_S if on_main_thread else None
    gold = parse("\\boxed{" + truth + "}", parsing_timeout=timeout)
    guess = parse("\\boxed{" + predicted + "}", parsing_timeout=timeout)
    if not gold or not guess:
        return None
    return bool(verify(gold, guess, timeout_seconds=timeout))


def equivalent(predicted: str, truth: str) -> bool:
    if normalise(predicted) == normalise(truth):
        return True
    if len(predicted) > MAX_ANSWER_CHARS:
        return False
    return bool(_math_verify_equal(predicted, truth))


def math_reward(completion: str, example: Example) -> float:
    predicted = last_boxed(completion)
    if predicted is None:
        return 0.0
    return 1.0 if equivalent(predicted, example.answer) else 0.0
