"""Multi-digit arithmetic: ``"{a}+{b}="`` -> ``"{a+b}"``.

Each operand first draws its digit count uniformly from [min_digits, max_digits], then
its value uniformly among numbers with that many digits (0-9 for one digit), so short
and long problems are equally likely. This is the setting TRL was measured on.
"""
from __future__ import annotations

import random

from asyncrl.data.tasks.base import SyntheticTask
from asyncrl.types import Example

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask(SyntheticTask):
    name = "arithmetic"

    def __init__(self, seed: int = 0, num_eval: int = 200, min_digits: int = 1, max_digits: int = 3,
                 operations: tuple[str, ...] = ("+",)):
        self.min_digits, self.max_digits = min_digits, max_digits
        self.operations = tuple(operations)
        self.charset = "0123456789=" + "".join(self.operations)
        super().__init__(seed, num_eval)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10 ** digits - 1)

    def sample(self, rng: random.Random) -> Example:
        a, b = self._operand(rng), self._operand(rng)
        op = rng.choice(self.operations)
        answer = str(_APPLY[op](a, b))
        prompt = f"{a}{op}{b}="
        return Example(prompt=prompt, answer=answer, fields={"answer": answer}, uid=prompt)

    def score(self, response: str, answer: str = "", finish_reason: str = "stop", **_) -> float:
        """1.0 for exactly the answer, terminated by EOS (not cut off by max_tokens)."""
        if not isinstance(response, str) or finish_reason != "stop":
            return 0.0
        return 1.0 if response.strip() == str(answer) else 0.0
