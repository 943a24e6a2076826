"""Demonstrations for SFT from a jsonl file of (prompt, response) rows."""
from __future__ import annotations

import random
from typing import Iterator

from asyncrl.data.jsonl import read_string_records
from asyncrl.types import Example

# Example.fields key of a multi-turn transcript's pieces, [(text, trained), ...], whose texts join
# to its answer: ``trained`` False marks text the model only reads (a tool's output), which SFT
# keeps out of the loss (asyncrl.training.sft.demonstration_batch).
SEGMENTS = "sft_segments"


def load_demonstrations(path: str, prompt_field: str = "prompt", response_field: str = "response") -> list[Example]:
    """Every row of ``path`` as an Example; a bad row is refused naming its line and field."""
    examples = [Example(prompt=row[prompt_field], answer=row[response_field], uid=str(line_no))
                for line_no, row in read_string_records(path, (prompt_field, response_field), "demonstrations file")]
    if not examples:
        raise ValueError(f"{path}: no demonstrations")
    return examples


def cycle_shuffled(examples: list[Example], seed: int) -> Iterator[Example]:
    """Endless epochs over ``examples``, each shuffled deterministically from ``seed``."""
    rng = random.Random(seed)
    while True:
        order = list(examples)
        rng.shuffle(order)
        yield from order
