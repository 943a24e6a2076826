"""Countdown: reach a target from given numbers with + - * / (each number used at most once).

Prompt ``"3,7,25>46:"``; a correct response is any expression such as ``"25+3*7"`` whose
numbers are a sub-multiset of the given ones and whose exact (rational) value is the
target. Targets are built from a random expression, so every problem is solvable and
that expression is the demonstration.
"""
from __future__ import annotations

import ast
import random
from collections import Counter
from fractions import Fraction
from typing import Optional

from asyncrl.data.tasks.base import SyntheticTask
from asyncrl.types import Example

_MAX_EXPRESSION_CHARS = 64
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def evaluate(expression: str) -> Optional[tuple[Fraction, list[int]]]:
    """(exact value, numbers used) of an arithmetic expression, or None if not one.

    Only integer literals, + - * / and parentheses are accepted; anything else
    (names, calls, powers, unary minus, division by zero, huge input) gives None.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS or not expression.strip():
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        numbers: list[int] = []
        return _eval_node(tree.body, numbers), numbers
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def _eval_node(node: ast.AST, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval_node(node.left, numbers), _eval_node(node.right, numbers)
        return _OPS[type(node.op)](left, right)
    raise ValueError("not a plain arithmetic expression")


class CountdownTask(SyntheticTask):
    name = "countdown"
    charset = "0123456789+-*/()=,>:"

    def __init__(self, seed: int = 0, num_eval: int = 200, num_numbers: int = 3,
                 max_number: int = 20, max_target: int = 200):
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        super().__init__(seed, num_eval)

    def sample(self, rng: random.Random) -> Example:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            expression = self._random_expression(rng, list(numbers))
            value = evaluate(expression)[0]
            if value.denominator == 1 and 1 <= value <= self.max_target:
                target = int(value)
                prompt = f"{','.join(map(str, numbers))}>{target}:"
                fields = {"numbers": numbers, "target": target, "answer": expression}
                return Example(prompt=prompt, answer=expression, fields=fields, uid=prompt)

    @staticmethod
    def _random_expression(rng: random.Random, numbers: list[int]) -> str:
        rng.shuffle(numbers)
        parts = [str(numbers[0])]
        for number in numbers[1:]:
            op = rng.choice("+-*")
            left = "".join(parts)
            # Parenthesise the running expression before * so that the demonstration
            # is evaluated left to right, as it was built.
            if op == "*" and any(c in left for c in "+-"):
                left = f"({left})"
            parts = [f"{left}{op}{number}"]
        return parts[0]

    def score(self, response: str, numbers: Optional[list[int]] = None, target: Optional[int] = None,
              finish_reason: str = "stop", **_) -> float:
        """1.0 if the response is an expression over the given numbers equal to the target."""
        if not isinstance(response, str) or numbers is None or target is None or finish_reason != "stop":
            return 0.0
        result = evaluate(_extract(response))
        if result is None:
            return 0.0
        value, used = result
        if Counter(used) - Counter(numbers):  # a number used more often than given
            return 0.0
        return 1.0 if value == target else 0.0


def _extract(response: str) -> str:
    """The expression inside ``<answer>...</answer>`` if tags are present, else the text.

    Unbalanced tags (an opening tag with no close, or the reverse) are tolerated: the
    text after the opening tag, or before the closing one, is taken.
    """
    text = response
    if "<answer>" in text:
        text = text.split("<answer>", 1)[1]
    if "</answer>" in text:
        text = text.split("</answer>", 1)[0]
    return text.strip()
