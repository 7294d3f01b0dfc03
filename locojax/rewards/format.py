"""`format`: 1 when the completion contains an answer in the format its task asks for, else 0.

The format comes from the example (`meta["answer_format"]`), so one reward serves every task; it is
the usual small shaping term next to a correctness reward.
"""

from __future__ import annotations

import re
from typing import Callable

from locojax.registry import Registry
from locojax.tasks.base import ANSWER_TAG_FORMAT, BOXED_FORMAT, GSM8K_FORMAT, Example
from locojax.tasks.math import last_boxed

FORMATS: Registry[Callable[[str], bool]] = Registry("answer format")

_GSM8K_LINE = re.compile(r"####\s*[-\u2212]?\s*\$?\s*[-\u2212]?\s*\.?\d")
_ANSWER_TAG = re.compile(r"<answer>\s*\S.*?</answer>", re.DOTALL)

FORMATS.register(GSM8K_FORMAT)(lambda completion: _GSM8K_LINE.search(completion) is not None)
FORMATS.register(BOXED_FORMAT)(lambda completion: last_boxed(completion) is not None)
FORMATS.register(ANSWER_TAG_FORMAT)(lambda completion: _ANSWER_TAG.search(completion) is not None)


def format_reward(completion: str, example: Example) -> float:
    answer_format = example.meta.get("answer_format")
    if answer_format is None:
        raise ValueError(f"example {example.uid} names no answer_format in its meta")
    return 1.0 if FORMATS.get(answer_format)(completion) else 0.0
