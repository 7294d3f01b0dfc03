"""`arith`: generated arithmetic word problems, answers in GSM8K form (`#### N`).

Built for the demo model (a few million parameters, byte tokenizer, max ~24 new tokens), so the
texts are deliberately terse: at difficulty 1 a prompt is one short sentence (~50 bytes) and the
reference is `12+5=17\\n#### 17` (~16 bytes). Harder levels add operations, one working line each.

Difficulty ladder (numbers and results stay non-negative integers):
  0  a bare equation `12+7=` (one + or -, numbers drawn as in level 1); the reference is `#### 19`.
     The demo level: at most 7 prompt tokens (with BOS) and 8 completion tokens (with EOS), so a
     GRPO step costs a fraction of a story problem's; the answer is computed in one shot, which a
     few minutes of SFT teaches only in part, leaving GRPO something to improve (locojax.demo)
  1  one + or -, every number (operands and result) 1-2 digits
  2  one +, - or x, operands up to 3 digits (x: a 1-digit factor)
  3  two steps of +, -, x, operands up to 2 digits
  4  three steps of +, -, x, exact /, operands up to 3 digits
  5  four steps, operands up to 4 digits

Example i is a pure function of (difficulty, i): any host can build any example without data files.
"""

from __future__ import annotations

import random

from locojax.tasks.base import GSM8K_FORMAT, Example, GeneratedTask

NAMES = ("Ann", "Bob", "Sam", "Eve", "Tom", "Mia", "Leo", "Zoe")
ITEMS = ("apples", "pens", "cards", "coins", "eggs", "books", "cups", "toys")

# One-step stories; {a} {b} are the operands. Kept short on purpose (see the module docstring).
_ONE_STEP = {
    "+": ("{name} has {a} {item} and gets {b} more. How many {item} now?",
          "{name} had {a} {item} and found {b}. How many now?"),
    "-": ("{name} has {a} {item} and gives away {b}. How many are left?",
          "{name} had {a} {item} and lost {b}. How many left?"),
    "*": ("{name} has {a} bags of {b} {item}. How many {item}?",),
}
# Multi-step stories: an opening, one clause per operation, a question.
_STEP_CLAUSE = {
    "+": "gets {b} more",
    "-": "gives away {b}",
    "*": "then has {b} times as many",
    "/": "then splits them into {b} equal parts and keeps one",
}

# difficulty -> (number of operations, allowed operations, largest operand)
LEVELS: dict[int, tuple[int, str, int]] = {
    0: (1, "+-", 99),
    1: (1, "+-", 99),
    2: (1, "+-*", 999),
    3: (2, "+-*", 99),
    4: (3, "+-*/", 999),
    5: (4, "+-*/", 9999),
}

NOMINAL_SIZE = 1_000_000  # generated: any index works; this only sets the epoch length


def _apply(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]


def _operand(rng: random.Random, op: str, value: int, largest: int) -> int | None:
    """An operand for `value op b` that keeps the result a non-negative integer; None if impossible."""
    if op == "+":
        return rng.randint(1, largest)
    if op == "-":
        return rng.randint(1, min(value, largest)) if value >= 1 else None
    if op == "*":
        return rng.randint(2, 9)  # small factors keep results (and reference lines) short
    divisors = [d for d in range(2, min(value, 99) + 1) if value % d == 0]
    return rng.choice(divisors) if divisors else None


def _one_step(rng: random.Random, difficulty: int) -> tuple[str, list[tuple[int, str, int, int]]]:
    _, ops, largest = LEVELS[difficulty]
    op = rng.choice(ops)
    if difficulty <= 1:
        # Keep every number 1-2 digits: a + b <= 99, a - b >= 0.
        if op == "+":
            a = rng.randint(1, 98)
            b = rng.randint(1, 99 - a)
        else:
            a = rng.randint(1, 99)
            b = rng.randint(1, a)
    elif op == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 9)
    else:
        a = rng.randint(1, largest)
        b = rng.randint(1, a if op == "-" else largest)
    template = rng.choice(_ONE_STEP[op])
    question = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return question, [(a, op, b, _apply(op, a, b))]


def _multi_step(rng: random.Random, difficulty: int) -> tuple[str, list[tuple[int, str, int, int]]]:
    n_ops, ops, largest = LEVELS[difficulty]
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, largest)
    steps: list[tuple[int, str, int, int]] = []
    clauses = []
    while len(steps) < n_ops:
        op = rng.choice(ops)
        b = _operand(rng, op, value, largest)
        if b is None:
            continue  # e.g. a prime can't be split evenly: pick another operation
        result = _apply(op, value, b)
        steps.append((value, op, b, result))
        clauses.append(_STEP_CLAUSE[op].format(b=b))
        value = result
    question = f"{name} has {steps[0][0]} {item}, " + ", ".join(clauses) + f". How many {item} now?"
    return question, steps


def make_example(difficulty: int, index: int) -> Example:
    if difficulty not in LEVELS:
        raise ValueError(f"arith difficulty must be one of {sorted(LEVELS)}, got {difficulty}")
    # String seeds are hashed with SHA-512 by `random`, so this is stable across processes and runs.
    rng = random.Random(f"arith:{difficulty}:{index}")
    question, steps = (_one_step if LEVELS[difficulty][0] == 1 else _multi_step)(rng, difficulty)
    answer = steps[-1][3]
    if difficulty == 0:
        a, op, b, _ = steps[0]
        return Example(uid=f"arith-d0-{index}", prompt=f"{a}{op}{b}=", reference=f"#### {answer}", answer=str(answer),
                       meta={"answer_format": GSM8K_FORMAT, "difficulty": 0, "steps": 1})
    working = "\n".join(f"{a}{op}{b}={result}" for a, op, b, result in steps)
    return Example(
        uid=f"arith-d{difficulty}-{index}",
        prompt=question + "\n",
        reference=f"{working}\n#### {answer}",
        answer=str(answer),
        meta={"answer_format": GSM8K_FORMAT, "difficulty": difficulty, "steps": len(steps)},
    )


class ArithTask(GeneratedTask):
    name = "arith"
    default_rewards = ("gsm8k",)
    levels = LEVELS
    nominal_size = NOMINAL_SIZE
    make_example = staticmethod(make_example)
