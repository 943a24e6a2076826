"""The synthetic-task contract: examples from a seed, an exact checker, a held-out split."""
from __future__ import annotations

import random
from abc import ABC, abstractmethod

from asyncrl.types import Example


class SyntheticTask(ABC):
    """A verifiable task generated from a seed.

    Invariant: no training example shares its prompt with a held-out example
    (``train_examples`` rejects every prompt in ``eval_examples``).
    """

    name: str = "task"
    # Every character a prompt or a correct answer can contain: the tiny model's
    # tokenizer covers exactly these, so probability pushed off a wrong answer cannot
    # leak to tokens the task never uses.
    charset: str = "0123456789"

    def __init__(self, seed: int, num_eval: int):
        self.seed = seed
        self.num_eval = num_eval
        self._eval = self._distinct(random.Random(f"{seed}-eval"), num_eval, exclude=set())
        self._eval_prompts = {ex.prompt for ex in self._eval}

    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """One random example (prompt, answer = a reference demonstration, fields)."""

    @abstractmethod
    def score(self, response: str, **fields) -> float:
        """Exact reward in [0, 1] for any string the model may produce."""

    def reward(self, prompt: str, response: str, **fields) -> float:
        """The reward-function contract ``fn(prompt, response, **fields)``."""
        return self.score(response, **fields)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def train_stream(self, seed: int):
        """An endless stream of training examples, none in the held-out set."""
        rng = random.Random(f"{self.seed}-train-{seed}")
        while True:
            ex = self.sample(rng)
            if ex.prompt not in self._eval_prompts:
                yield ex

    def _distinct(self, rng: random.Random, count: int, exclude: set[str]) -> list[Example]:
        seen, out = set(exclude), []
        for _ in range(count * 1000):
            ex = self.sample(rng)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                out.append(ex)
                if len(out) == count:
                    return out
        raise ValueError(f"{self.name}: could not draw {count} distinct held-out examples; widen the task")
