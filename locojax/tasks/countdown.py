"""`countdown`: generated (numbers, target) puzzles; the answer is an equation in `<answer></answer>`.

The shape follows the Countdown task of TinyZero (FACTS.md, "Workloads"): reach the target with
+ - * / and parentheses, each given number used at most once. Every puzzle is solvable by
construction: the target is the value of a random expression over a subset of the numbers, and that
expression is the reference completion.

Difficulty ladder: (how many numbers, largest number, allowed operations)
  1  3 numbers up to 20, + - *        2  4 numbers up to 50, + - * /
  3  4 numbers up to 100              4  5 numbers up to 100        5  6 numbers up to 100
"""

from __future__ import annotations

import random

from locojax.tasks.base import ANSWER_TAG_FORMAT, Example, GeneratedTask

LEVELS: dict[int, tuple[int, int, str]] = {
    1: (3, 20, "+-*"),
    2: (4, 50, "+-*/"),
    3: (4, 100, "+-*/"),
    4: (5, 100, "+-*/"),
    5: (6, 100, "+-*/"),
}
NOMINAL_SIZE = 1_000_000
MAX_TARGET = 999  # keeps targets (and the model's arithmetic) in three digits


def _combine(rng: random.Random, text: str, value: int, additive: bool, number: int, ops: str):
    """Extend the expression `text` (= value) by one number; None when no op keeps it a positive integer.

    `additive` says whether `text`'s top-level operator is + or -, which needs parentheses before
    * or /. Returns (text, value, additive).
    """
    candidates = list(ops)
    rng.shuffle(candidates)
    for op in candidates:
        if op == "+":
            return f"{text}+{number}", value + number, True
        if op == "-" and value - number > 0:
            return f"{text}-{number}", value - number, True
        if op == "-" and number - value > 0 and not additive:
            # `number - (expr)`: only without parentheses trouble, i.e. a product or a single number.
            return f"{number}-{text}", number - value, True
        if op in "*/":
            left = f"({text})" if additive else text
            if op == "*" and value * number <= MAX_TARGET:
                return f"{left}*{number}", value * number, False
            if op == "/" and number > 1 and value % number == 0:
                return f"{left}/{number}", value // number, False
    return None


def make_example(difficulty: int, index: int) -> Example:
    if difficulty not in LEVELS:
        raise ValueError(f"countdown difficulty must be one of {sorted(LEVELS)}, got {difficulty}")
    count, largest, ops = LEVELS[difficulty]
    rng = random.Random(f"countdown:{difficulty}:{index}")
    while True:  # a few draws at most: most subsets give a valid target
        numbers = [rng.randint(1, largest) for _ in range(count)]
        used = rng.sample(numbers, rng.randint(2, count))
        text, value, additive = str(used[0]), used[0], False
        for number in used[1:]:
            step = _combine(rng, text, value, additive, number, ops)
            if step is None:
                break
            text, value, additive = step
        else:
            if 1 <= value <= MAX_TARGET:
                break
    listed = " ".join(map(str, numbers))
    return Example(
        uid=f"countdown-d{difficulty}-{index}",
        prompt=f"Use {listed} (each at most once, + - * /) to make {value}. Answer in <answer></answer>.\n",
        reference=f"<answer>{text}</answer>",
        answer=str(value),
        meta={"answer_format": ANSWER_TAG_FORMAT, "numbers": tuple(numbers), "target": value,
              "difficulty": difficulty},
    )


class CountdownTask(GeneratedTask):
    name = "countdown"
    default_rewards = ("countdown",)
    levels = LEVELS
    nominal_size = NOMINAL_SIZE
    make_example = staticmethod(make_example)
