"""`math`: a local JSONL or parquet with `problem` and `solution` (MATH, NuminaMath-CoT).

The ground truth is the content of the solution's last `\\boxed{...}`. Rows whose solution has no
boxed answer cannot be scored; real dumps (NuminaMath-CoT) contain some, so they are skipped and
counted (`MathTask.skipped`) rather than failing the run — but a file where *no* row has one is an
error, since then the wrong file was given.
"""

from __future__ import annotations

import logging

from locojax.tasks.base import BOXED_FORMAT, DataFormatError, Example, read_records

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = "Problem: {problem}\nSolve step by step and put the final answer in \\boxed{{}}.\nSolution: "

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`), braces balanced; None if absent."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(command):]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        # `\boxed 5`: the argument is the next token, up to a space or `$`.
        token = rest.lstrip().split("$", 1)[0].split()[0] if rest.strip() else ""
        return token or None
    rest = rest.lstrip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for position, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                content = rest[1:position].strip()
                return content or None
    return None  # unbalanced: the completion was cut off inside the box


class MathTask:
    name = "math"
    default_rewards = ("math",)

    def __init__(self, path: str):
        records, unit = read_records(path, ("problem", "solution"))
        self.path = str(path)
        self._examples: list[Example] = []
        skipped: list[int] = []
        for number, record in records:
            answer = last_boxed(record["solution"])
            if answer is None:
                skipped.append(number)
                continue
            self._examples.append(Example(
                uid=f"math-{len(self._examples)}",
                prompt=PROMPT_TEMPLATE.format(problem=record["problem"].strip()),
                reference=record["solution"].strip(),
                answer=answer,
                meta={"answer_format": BOXED_FORMAT, "source_line": number},
            ))
        self.skipped = len(skipped)
        if not self._examples:
            raise DataFormatError(path, skipped[0], "solution", "no \\boxed{} answer in any record", unit)
        if skipped:
            log.warning("%s: skipped %d of %d records without a \\boxed{} answer (first at %s %d)",
                        path, len(skipped), len(records), unit, skipped[0])

    def __len__(self) -> int:
        return len(self._examples)

    def example(self, index: int) -> Example:
        return self._examples[index]
