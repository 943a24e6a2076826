"""The final answer of a response, normalised so that equal answers vote together (maj@k).

Extraction follows the math reward's order: the text after the last ``####`` (GSM8K),
else the last ``\\boxed{...}``, else the last number in the text. Normalisation is
textual (spaces, ``$``, thousands separators, ``\\dfrac``, trailing zeros), which is
enough to group samples; correctness itself is always the reward's verdict.
"""
from __future__ import annotations

import re
from typing import Optional

from asyncrl.rewards.math import extract_gsm8k

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1:i]
    return None  # unbalanced: the response was cut off inside the box


def normalize_answer(answer: str) -> Optional[str]:
    text = answer.strip().strip("$").strip().rstrip(".")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "").replace("\\right", "")
    text = re.sub(r"\s+", "", text)
    if re.fullmatch(r"-?[\d,]*\.?\d+", text):
        number = float(text.replace(",", ""))
        return str(int(number)) if number.is_integer() else repr(number)
    return text or None


def final_answer(response: str) -> Optional[str]:
    """The normalised final answer of ``response``, or None when it has none."""
    found = extract_gsm8k(response) or last_boxed(response)
    if found is None:
        numbers = _NUMBER.findall(response)
        found = numbers[-1] if numbers else None
    return normalize_answer(found) if found is not None else None
