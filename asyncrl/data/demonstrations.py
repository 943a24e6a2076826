"""Demonstrations for SFT from a jsonl file of (prompt, response) rows."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator

from asyncrl.types import Example


def load_demonstrations(path: str, prompt_field: str = "prompt", response_field: str = "response") -> list[Example]:
    """Every row of ``path`` as an Example; a bad row is refused naming its line and field."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"demonstrations file '{path}' does not exist")
    examples = []
    for line_no, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
        for name in (prompt_field, response_field):
            if not isinstance(row, dict) or not isinstance(row.get(name), str):
                raise ValueError(f"{path}:{line_no}: missing string field '{name}'")
        examples.append(Example(prompt=row[prompt_field], answer=row[response_field], uid=str(line_no)))
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
