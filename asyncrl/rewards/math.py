"""Math answer verification: our final-answer extraction, math-verify's comparison.

Why math-verify: it is the checker open-r1 and TRL use; it parses LaTeX and plain
expressions into sympy and compares them symbolically (fractions, sets, intervals,
matrices, percentages), so ``0.5``, ``1/2`` and ``\\frac{1}{2}`` are one answer.

What we add around it:
  * *which* answer: ``final_answer.find_final_answer`` picks the final answer span (the
    last box, else the last final-answer line; never "the last number anywhere" unless
    ``last_number_fallback=True``), because math-verify's own extraction merges every
    ``\\boxed{}`` of a self-correcting response into a set and falls back to the last
    number of the text;
  * the span is handed to math-verify boxed, with the extraction config TRL's
    ``accuracy_reward`` uses for completions (``LatexExtractionConfig(
    normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
    try_extract_without_anchor=False)``, ``extraction_mode="first_match"``: the answer
    must be well-formed LaTeX, e.g. ``\\frac{1}{2}`` not ``\\frac12``); the reference,
    as TRL does, with math-verify's default config;
  * a cost bound: a parsed answer whose value would need more than ``MAX_DIGITS``
    digits to compare (``(10!)!``, ``10^{10^{10}}``) is refused before sympy evaluates
    it (a C-level bignum loop cannot be interrupted), and in the main thread (a
    process-mode pool worker, a script) a timer stops parse + compare after
    ``time_limit_s`` (0.5 s of CPU time): either way the answer scores 0.
"""
from __future__ import annotations

import functools
import math
import signal
import threading
from contextlib import contextmanager
from typing import Any, Optional

from asyncrl.rewards.final_answer import FinalAnswer, extract_gsm8k, find_final_answer

__all__ = ["answers_match", "extract_gsm8k", "math_reward", "MAX_DIGITS"]

# The final answer of a model is at the end; a 1 MB garbage response must not make
# the extraction read all of it.
MAX_RESPONSE_CHARS = 4000
MAX_DIGITS = 100_000  # of any number the comparison would have to build
_EVALUATING_FUNCTIONS = {"factorial", "factorial2", "subfactorial", "binomial", "gamma", "RisingFactorial",
                         "FallingFactorial", "fibonacci", "lucas", "bell", "catalan", "harmonic"}


class _OutOfTime(Exception):
    pass


@functools.lru_cache(maxsize=1)
def _math_verify():
    """math-verify and the config, imported (and warmed) once, outside any time budget."""
    import logging

    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    # We run math-verify without its own signal timeouts (ours is below); it warns once.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                    boxed_match_priority=0, try_extract_without_anchor=False)]

    def parse_answer(text: str) -> list:
        return parse("\\boxed{" + text + "}", extraction_config=config, extraction_mode="first_match",
                     parsing_timeout=None)

    def parse_gold(text: str) -> list:  # TRL parses the reference with math-verify's defaults
        return parse("\\boxed{" + text + "}", parsing_timeout=None)

    parse_answer("1")  # compiles math-verify's regexes and the LaTeX parser
    return parse_answer, parse_gold, verify


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    """Parse a reference answer; cached because the G samples of a group share it.
    A full solution (GSM8K ``#### n``, a boxed MATH solution) is reduced to its final
    answer; a bare answer (``27.0``, ``\\frac{1}{2}``, ``(1, 2]``) is taken whole."""
    _, parse_gold, _ = _math_verify()
    text = gold.strip()
    if "\\boxed" in text or "\\fbox" in text or "####" in text:
        found = find_final_answer(text)
        text = found.text if found is not None else text
    return tuple(parse_gold(text))


def answers_match(gold: Any, response: str, time_limit_s: float = 0.5, last_number_fallback: bool = False) -> bool:
    """True when ``response``'s final answer is equivalent to ``gold``.

    Raises ValueError when the gold answer cannot be parsed (a data problem the user
    must see); anything wrong on the response side (no final answer, two different
    ones, unparseable, too costly, out of time) is a wrong answer.
    """
    gold_parsed = _parse_gold(_gold_text(gold))
    if not gold_parsed:
        raise ValueError(f"math reward: cannot parse the reference answer {gold!r}")
    if not isinstance(response, str) or not response.strip():
        return False
    found = find_final_answer(response[-MAX_RESPONSE_CHARS:], last_number_fallback)
    if found is None:
        return False
    try:
        with _time_budget(time_limit_s):
            return _compare(gold_parsed, found)
    except Exception:  # sympy can raise anything on adversarial input; that is "wrong"
        return False


def _compare(gold_parsed: tuple, found: FinalAnswer) -> bool:
    parse_answer, _, verify = _math_verify()
    predicted = parse_answer(found.text)
    if not predicted or any(_too_costly(p) for p in predicted):
        return False
    return bool(verify(list(gold_parsed), predicted, timeout_seconds=None))


@contextmanager
def _time_budget(seconds: float):
    """Raise _OutOfTime in this block once it has used ``seconds`` of CPU time.

    CPU time (ITIMER_PROF), not wall time: the cost of an answer is what it burns, and
    on a loaded machine a correct answer's wall time stretches while its CPU time does
    not. A signal timer needs the main thread; elsewhere the cost screen is the bound.
    The process's CPU time counts all its threads: in a busy multi-threaded process the
    budget runs out sooner (process-mode pool workers are single-threaded).
    """
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def out_of_time(signum, frame):
        raise _OutOfTime()

    previous = signal.signal(signal.SIGPROF, out_of_time)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def _too_costly(expr) -> bool:
    """Would comparing this need a number of more than MAX_DIGITS digits?"""
    try:
        return _digits(expr) > MAX_DIGITS
    except (RecursionError, OverflowError, ValueError, TypeError, AttributeError):
        return True


def _digits(expr) -> float:
    """An upper bound of log10(|value| + 1) of a parsed answer (sympy tree or string).

    Symbols count as two-digit numbers, so ``x^{10^{10}}`` is refused too (expanding
    it would hang just the same). Functions that evaluate to huge integers
    (factorials, binomials, ...) count by their argument: n! has n*log10(n) digits.
    """
    import sympy

    if isinstance(expr, str):
        return 0.0
    if isinstance(expr, sympy.Integer):
        return _log10_int(int(expr))
    if isinstance(expr, sympy.Rational):
        return _log10_int(int(expr.p)) + _log10_int(int(expr.q))
    if isinstance(expr, (sympy.Float, sympy.NumberSymbol)) or expr in (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return 20.0
    if isinstance(expr, sympy.Symbol):
        return 2.0
    args = getattr(expr, "args", ())
    if isinstance(expr, sympy.Pow):
        base, exponent = args
        size = abs(int(exponent)) if isinstance(exponent, sympy.Integer) else _value_bound(_digits(exponent))
        return _digits(base) * size + 1.0
    if isinstance(expr, sympy.Mul):
        return sum(_digits(a) for a in args)
    if type(expr).__name__ in _EVALUATING_FUNCTIONS:
        n = _value_bound(max((_digits(a) for a in args), default=0.0))
        return n * max(1.0, math.log10(n + 1)) if n < 1e12 else math.inf
    return max((_digits(a) for a in args), default=0.0) + 1.0  # Add, sets, tuples, Eq, functions


def _value_bound(digits: float) -> float:
    return 10.0 ** digits if digits < 300 else math.inf


def _log10_int(n: int) -> float:
    n = abs(n)
    return math.log10(n + 1) if n.bit_length() < 1000 else n.bit_length() * 0.30103


def _gold_text(gold: Any) -> str:
    """Reference answers arrive as str, int or float (AMC's answers are floats)."""
    if isinstance(gold, float) and gold.is_integer():
        return str(int(gold))
    if gold is None or (isinstance(gold, str) and not gold.strip()):
        raise ValueError("math reward: the example has no reference answer (field 'answer')")
    return str(gold)


def math_reward(prompt: str, response: str, answer: Any = None, time_limit_s: float = 0.5,
                last_number_fallback: bool = False, **fields: Any) -> float:
    """1.0 if the response's final answer equals the reference ``answer``, else 0.0.

    ``answer`` may be a bare answer, LaTeX, or a full GSM8K/MATH solution. A recipe that
    wants answers without any final-answer marker credited passes
    ``last_number_fallback=True``. Extra fields are ignored.
    """
    return 1.0 if answers_match(answer, response, time_limit_s, last_number_fallback) else 0.0
