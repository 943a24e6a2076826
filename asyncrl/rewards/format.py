"""Format rewards: does the response have the required structure?

These are cheap, pure-Python checks (run them in the pool's ``inline`` mode):
  * ``think_answer_format``: the DeepSeek-R1 layout ``<think>...</think><answer>...</answer>``;
  * ``tags_reward``: each required tag pair present exactly once, optionally in order;
  * ``regex_reward``: the response matches a user pattern (``pattern`` field or kwarg).
"""
from __future__ import annotations

import functools
import re
from typing import Any, Sequence

_THINK_ANSWER = re.compile(
    r"^\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*$", re.DOTALL
)


def think_answer_format(prompt: str, response: str, **fields: Any) -> float:
    """1.0 for exactly ``<think>...</think><answer>...</answer>`` (whitespace allowed
    around the blocks), both non-empty and with no nested copies of the tags."""
    match = _THINK_ANSWER.match(response or "")
    if match is None:
        return 0.0
    think, answer = match.group("think"), match.group("answer")
    if not think.strip() or not answer.strip():
        return 0.0
    if any(tag in think + answer for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return 0.0
    return 1.0


def extract_tag(response: str, tag: str) -> str | None:
    """The content of the last ``<tag>...</tag>`` block, or None."""
    blocks = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", response or "", re.DOTALL)
    return blocks[-1].strip() if blocks else None


def tags_reward(
    prompt: str, response: str, tags: Sequence[str] = ("think", "answer"), ordered: bool = True,
    **fields: Any,
) -> float:
    """Fraction of ``tags`` whose ``<tag>...</tag>`` pair appears exactly once.

    With ``ordered``, a tag found before the previous one does not count, so
    ``<answer>..</answer><think>..</think>`` scores 0.5 for ``("think", "answer")``.
    Partial credit gives a denser signal early in training than all-or-nothing.
    """
    text = response or ""
    found, last_end = 0, -1
    for tag in tags:
        opens = [m.start() for m in re.finditer(f"<{re.escape(tag)}>", text)]
        closes = [m.start() for m in re.finditer(f"</{re.escape(tag)}>", text)]
        if len(opens) != 1 or len(closes) != 1 or closes[0] < opens[0]:
            continue
        if ordered and opens[0] < last_end:
            continue
        found += 1
        last_end = closes[0]
    return found / len(tags) if tags else 1.0


@functools.lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


def regex_reward(
    prompt: str, response: str, pattern: str | None = None, fullmatch: bool = False,
    **fields: Any,
) -> float:
    """1.0 if ``pattern`` is found in the response (or matches all of it with
    ``fullmatch``). ``pattern`` comes from the dataset row or from
    ``functools.partial(regex_reward, pattern=...)``."""
    if not pattern:
        raise ValueError("regex_reward needs a 'pattern' (dataset field or keyword argument)")
    compiled = _compile(pattern)
    text = response or ""
    hit = compiled.fullmatch(text) if fullmatch else compiled.search(text)
    return 1.0 if hit else 0.0
