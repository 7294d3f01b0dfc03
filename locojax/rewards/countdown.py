"""Countdown: the `<answer>` equation, parsed without `eval`, must reach the target.

A small recursive-descent parser over + - * / and parentheses, exact arithmetic with fractions (so
`(8/3)*3` is 8, not 7.999...), each given number used at most once (as a multiset: a number listed
twice may be used twice). An optional `= target` at the end is accepted; anything else — other
symbols, numbers not given, division by zero, a different result — scores 0.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

from locojax.tasks.base import Example

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
MAX_EQUATION_CHARS = 200  # bounds the parser's recursion; real answers are a few dozen characters


class EquationError(ValueError):
    """The text is not an equation over the allowed symbols."""


def last_answer_tag(text: str) -> str | None:
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def _tokens(text: str) -> list[str]:
    text = text.replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-").strip()
    out = []
    for number, symbol in _TOKEN.findall(text):
        if number:
            out.append(number)
        elif symbol in "+-*/()":
            out.append(symbol)
        elif not symbol.isspace():
            raise EquationError(f"unexpected symbol {symbol!r}")
    return out


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := '-' factor | N | '(' expr ')'"""

    def __init__(self, tokens: list[str]):
        self.tokens, self.position, self.numbers = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise EquationError("unexpected end of equation")
        self.position += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.factor()
            if op == "/" and right == 0:
                raise EquationError("division by zero")
            value = value * right if op == "*" else value / right
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token == "-":
            return -self.factor()
        if token == "(":
            value = self.expr()
            if self.take() != ")":
                raise EquationError("unbalanced parentheses")
            return value
        if token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise EquationError(f"unexpected {token!r}")


def evaluate(equation: str) -> tuple[Fraction, list[int]]:
    """Value of `equation` and the numbers it uses. Raises EquationError if it is not one."""
    if len(equation) > MAX_EQUATION_CHARS:
        raise EquationError(f"longer than {MAX_EQUATION_CHARS} characters")
    parser = _Parser(_tokens(equation))
    value = parser.expr()
    if parser.peek() is not None:
        raise EquationError(f"unexpected {parser.peek()!r}")
    return value, parser.numbers


def countdown(completion: str, example: Example) -> float:
    equation = last_answer_tag(completion)
    if equation is None:
        return 0.0
    target = Fraction(int(example.meta["target"]))
    if equation.count("=") == 1:
        equation, stated = equation.split("=")
        if not stated.strip().isdigit() or Fraction(int(stated)) != target:
            return 0.0
    try:
        value, used = evaluate(equation)
    except EquationError:
        return 0.0
    if Counter(used) - Counter(int(n) for n in example.meta["numbers"]):
        return 0.0  # a number not given, or one given once used twice
    return 1.0 if value == target else 0.0
