"""`gsm8k`: a local JSONL (or parquet) in the original release's format.

Each record has `question` and `answer`; `answer` is a worked solution whose last line is `#### N`
(openai/grade-school-math). The worked solution, with its `<<48/2=24>>` calculator annotations
removed, is the reference completion; N (commas dropped) is the ground truth.
"""

from __future__ import annotations

import re

from locojax.tasks.base import GSM8K_FORMAT, DataFormatError, Example, read_records

PROMPT_TEMPLATE = "Question: {question}\nSolve step by step and end with a line '#### <number>'.\nAnswer: "

_CALCULATOR = re.compile(r"<<[^<>]*>>")
_FINAL_NUMBER = re.compile(r"^-?\$?\s*(\d[\d,]*(\.\d+)?|\.\d+)$")


def final_answer(answer_text: str) -> str | None:
    """The N of the last `#### N` line with commas and `$` dropped; None if there is none or N is not a number."""
    if "####" not in answer_text:
        return None
    tail = answer_text.rsplit("####", 1)[1].strip().rstrip(".")
    if not _FINAL_NUMBER.match(tail):
        return None
    return tail.replace(",", "").replace("$", "").replace(" ", "")


class GSM8KTask:
    name = "gsm8k"
    default_rewards = ("gsm8k",)

    def __init__(self, path: str):
        records, unit = read_records(path, ("question", "answer"))
        self.path = str(path)
        self._examples: list[Example] = []
        for number, record in records:
            answer = final_answer(record["answer"])
            if answer is None:
                raise DataFormatError(path, number, "answer", "does not end with a line '#### <number>'", unit)
            solution = _CALCULATOR.sub("", record["answer"]).strip()
            self._examples.append(Example(
                uid=f"gsm8k-{len(self._examples)}",
                prompt=PROMPT_TEMPLATE.format(question=record["question"].strip()),
                reference=solution,
                answer=answer,
                meta={"answer_format": GSM8K_FORMAT, "source_line": number},
            ))

    def __len__(self) -> int:
        return len(self._examples)

    def example(self, index: int) -> Example:
        return self._examples[index]
