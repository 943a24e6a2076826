"""Math answer verification with math-verify.

Why math-verify: it is the checker that open-r1 and TRL use; it parses LaTeX and plain
expressions into sympy and compares them symbolically (fractions, sets, intervals,
matrices, percentages), so ``0.5``, ``1/2`` and ``\\frac{1}{2}`` are one answer.
Writing our own normaliser would re-learn its thousand edge cases.

Extraction:
  * a GSM8K-style ``#### 42`` anywhere in the text wins (the text after the last one);
  * otherwise math-verify's own extraction, which prefers the last ``\\boxed{}`` and
    falls back to the last LaTeX or plain expression.

Timeouts: math-verify guards sympy with ``signal.alarm``, which works only in the
main thread (elsewhere it raises). We pass its timeouts only when running in the main
thread; in worker threads they are off and the ``RewardPool``'s per-call timeout is
the guard (its process mode kills a hung call).
"""
from __future__ import annotations

import functools
import re
import threading
from typing import Any, Optional

# The final answer of a model is at the end; a 1 MB garbage response must not make
# sympy parse all of it. Keep the tail only.
MAX_RESPONSE_CHARS = 4000
_GSM8K_ANSWER = re.compile(r"####\s*(.+)")
# A leading number after "####" ("18.", "18 dollars", "$1,000"): the number alone.
_LEADING_NUMBER = re.compile(r"^\$?\s*(-?[\d,]*\.?\d+)(?![\d/^{])")


def _timeout() -> Optional[int]:
    """math-verify's timeout (seconds) when signals are usable here, else None."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def extract_gsm8k(text: str) -> Optional[str]:
    """The answer after the last ``####`` (thousands separators and ``$`` removed)."""
    matches = _GSM8K_ANSWER.findall(text)
    if not matches or not matches[-1].strip():
        return None
    answer = matches[-1].strip().splitlines()[0]
    number = _LEADING_NUMBER.match(answer)
    if number:
        return number.group(1).replace(",", "")
    return answer.replace("$", "").strip() or None


def _parse(text: str) -> list:
    from math_verify import parse  # deferred: importing sympy costs ~1 s

    return parse(text, parsing_timeout=_timeout())


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    """Parse a reference answer; cached because the G samples of a group share it."""
    text = gold.strip()
    gsm8k = extract_gsm8k(text)
    if gsm8k is not None:
        text = gsm8k
    if "\\boxed" not in text:
        # A bare answer ("27.0", "\\frac{1}{2}", "(1, 2]") is boxed so that LaTeX
        # extraction treats the whole string as the answer, not its last number.
        text = "\\boxed{" + text + "}"
    return tuple(_parse(text))


def _parse_response(response: str) -> list:
    tail = response[-MAX_RESPONSE_CHARS:]
    gsm8k = extract_gsm8k(tail)
    if gsm8k is not None:
        return _parse("\\boxed{" + gsm8k + "}")
    return _parse(tail)


def answers_match(gold: Any, response: str) -> bool:
    """True when ``response``'s final answer is equivalent to ``gold``.

    Raises ValueError when the gold answer cannot be parsed (a data problem the user
    must see); any failure on the response side is a wrong answer.
    """
    from math_verify import verify

    gold_parsed = _parse_gold(_gold_text(gold))
    if not gold_parsed:
        raise ValueError(f"math reward: cannot parse the reference answer {gold!r}")
    if not isinstance(response, str) or not response.strip():
        return False
    try:
        predicted = _parse_response(response)
        if not predicted:
            return False
        return bool(verify(list(gold_parsed), predicted, timeout_seconds=_timeout()))
    except Exception:  # sympy can raise anything on adversarial input; that is "wrong"
        return False


def _gold_text(gold: Any) -> str:
    """Reference answers arrive as str, int or float (AMC's answers are floats)."""
    if isinstance(gold, float) and gold.is_integer():
        return str(int(gold))
    if gold is None or (isinstance(gold, str) and not gold.strip()):
        raise ValueError("math reward: the example has no reference answer (field 'answer')")
    return str(gold)


def math_reward(prompt: str, response: str, answer: Any = None, **fields: Any) -> float:
    """1.0 if the response's final answer equals the reference ``answer``, else 0.0.

    ``answer`` may be a bare answer, LaTeX, or a full GSM8K solution ending in
    ``#### n``. Extra fields are ignored.
    """
    return 1.0 if answers_match(answer, response) else 0.0
