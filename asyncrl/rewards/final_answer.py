"""The final answer of a response, as text: what the math reward compares.

A response states its final answer once, at the end; everything before it is working.
So the answer is, in this order:

  1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), together with the boxes right before
     it that only separators join to it (``\\boxed{3} or \\boxed{5}``): those are offered
     together, so they are kept together (as a set, which equals no single answer). An
     earlier box followed by more working ("wait, ... \\boxed{5}") is a corrected answer
     and is dropped;
  2. else the last final-answer line: GSM8K's ``#### 42``, or "the (final) answer is
     ...", "Answer: ..." (rest of the line, or the next line when that is empty);
  3. else, a response that is nothing but an answer (``42``, ``$\\frac{1}{2}$``);
  4. else nothing: the response gave no final answer. The last number anywhere in the
     text is *not* an answer unless the caller asks for that fallback.

Alternatives inside an answer line ("5 or 6", "5 and 6", "5; 6") become a list
("5, 6"): the comparison then sees every value offered, never just the first.

Before all this the text is normalised: Unicode minus signs become ``-``, Unicode
spaces become spaces (thin/no-break spaces between digit groups, as in ``1 000``,
disappear), zero-width characters go, and markdown heading markers (``#### Step 1``)
lose their ``#``: a heading is not GSM8K's answer marker, which is followed by the
answer itself.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_MINUS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad]")
_GROUP_SPACE = re.compile(r"(?<=\d)[\u00a0\u2007\u2009\u202f](?=\d{3}(?!\d))")
_UNICODE_SPACE = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_HEADING = re.compile(r"^[ \t]{0,3}(#{1,6})[ \t]+(.*)$", re.MULTILINE)
# GSM8K's marker is followed by the answer itself: a number, a sign, $, LaTeX, a bracket.
_ANSWER_START = re.compile(r"[-+$\\(\[{.\d]")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_SEPARATOR = re.compile(
    r"^(?:[\s,;.$]|\\[,;:!]|\\quad|\\qquad|\\text\{\s*(?:and|or)?\s*\}|\band\b|\bor\b|\\(?:text|mathrm)\{[\s,]*\})*$")
_ANSWER_PHRASE = re.compile(
    r"(?:^|(?<=[\s*_>]))(?:(?:the\s+)?final\s+answer|the\s+answer|answer)\s*(?:is\s*:?|:|=)[ \t]*",
    re.IGNORECASE | re.MULTILINE)
_GSM8K_MARKER = re.compile(r"####[ \t]*(.*)$", re.MULTILINE)
_ALTERNATIVES = re.compile(r"\s+(?:or|and)\s+|\s*;\s*|\s*\\text\{\s*(?:or|and)\s*\}\s*", re.IGNORECASE)
_LEADING_NUMBER = re.compile(r"^\$?\s*(-?\d[\d,]*(?:\.\d+)?|-?\.\d+)(?:\s*[a-zA-Z][a-zA-Z .]*)?\.?$")
_BARE_ANSWER = re.compile(r"^[\s$]*[-+\d.,(\[{\\][^a-zA-Z]*(?:\\[a-zA-Z]+[^a-zA-Z]*)*[\s$.]*$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
MAX_ANSWER_CHARS = 1000


@dataclass(frozen=True)
class FinalAnswer:
    """``text``: the answer to compare (alternatives joined by ", "); ``source``: "boxed",
    "answer line", "bare" or "last number" (only with the fallback)."""

    text: str
    source: str


def normalize_text(text: str) -> str:
    """Unicode minus/spaces/zero-width characters and markdown heading markers."""
    text = _ZERO_WIDTH.sub("", text.translate(_MINUS))
    text = _UNICODE_SPACE.sub(" ", _GROUP_SPACE.sub("", text))
    return _HEADING.sub(_unhead, text)


def _unhead(match: re.Match) -> str:
    hashes, content = match.group(1), match.group(2)
    if hashes == "####" and _ANSWER_START.match(content.strip("*_ ")):
        return match.group(0)  # GSM8K's answer marker
    return content


def find_final_answer(response: str, last_number_fallback: bool = False) -> Optional[FinalAnswer]:
    """The response's final answer (see the module docstring), or None."""
    text = normalize_text(response)
    found = _boxed(text)
    if found is None:
        found = _answer_line(text)
    if found is None:
        bare = text.strip()
        if bare and len(bare) <= 80 and _BARE_ANSWER.match(bare):
            found = FinalAnswer(_clean(bare), "bare")
    if found is None and last_number_fallback:
        numbers = _NUMBER.findall(text)
        found = FinalAnswer(numbers[-1].replace(",", ""), "last number") if numbers else None
    if found is None or not found.text or len(found.text) > MAX_ANSWER_CHARS:
        return None
    return found


def last_boxed_group(text: str) -> list[str]:
    """Contents of the last box and of the boxes that only separators join to it."""
    boxes = _boxes(text)
    if not boxes:
        return []
    group = [boxes[-1]]
    for previous in reversed(boxes[:-1]):
        between = text[previous[2]:group[0][1]]
        if len(between) > 200 or not _BOX_SEPARATOR.match(between):
            break
        group.insert(0, previous)
    return [content for content, _, _ in group]


def _boxed(text: str) -> Optional[FinalAnswer]:
    contents = [c.strip() for c in last_boxed_group(text)]
    unique = list(dict.fromkeys(c for c in contents if c))
    return FinalAnswer(", ".join(unique), "boxed") if unique else None


def _boxes(text: str) -> list[tuple[str, int, int]]:
    """(content, start, end) of every box whose braces close."""
    found = []
    for match in _BOX.finditer(text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append((text[match.end():i - 1], match.start(), i))
    return found


def _answer_line(text: str) -> Optional[FinalAnswer]:
    """The last GSM8K marker or answer phrase, and what follows it on its line."""
    candidates = [(m.start(1), m.group(1)) for m in _GSM8K_MARKER.finditer(text)]
    candidates += [(m.end(), _rest_of_line(text, m.end())) for m in _ANSWER_PHRASE.finditer(text)]
    if not candidates:
        return None
    position, line = max(candidates, key=lambda c: c[0])
    if not line.strip(" *_:$."):
        line = _next_line(text, position)
    line = _first_sentence(line)
    parts = [_number_or_expression(p) for p in _ALTERNATIVES.split(_clean(line)) if p.strip(" .,")]
    return FinalAnswer(", ".join(parts), "answer line") if parts else None


def _rest_of_line(text: str, start: int) -> str:
    end = text.find("\n", start)
    return text[start:] if end < 0 else text[start:end]


def _next_line(text: str, position: int) -> str:
    end = text.find("\n", position)
    for line in ([] if end < 0 else text[end + 1:].splitlines()):
        if line.strip():
            return line
    return ""


def _first_sentence(line: str) -> str:
    """Up to a sentence end ("5. I hope it is correct."), keeping decimals and $...$."""
    match = re.search(r"(?<!\\)\.(?=\s+[A-Z])", line)
    return line[:match.start()] if match else line


def _clean(answer: str) -> str:
    """Markdown emphasis, math delimiters and trailing punctuation off an answer."""
    answer = answer.strip().strip("*_").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) > len(left) + len(right):
            answer = answer[len(left):-len(right)].strip()
    answer = re.sub(r"(?<!\\)%", r"\\%", answer)  # "%" starts a LaTeX comment
    return answer.rstrip(" .,;:!").strip()


def _number_or_expression(part: str) -> str:
    """"18 dollars" -> "18"; "$1,000" -> "1,000"; anything else as written."""
    part = part.strip().strip("*_").strip()
    number = _LEADING_NUMBER.match(part)
    return number.group(1) if number else _clean(part)


def extract_gsm8k(text: str) -> Optional[str]:
    """The answer after the last GSM8K ``####`` marker (not a heading), with ``$`` and
    thousands separators removed: ``"#### 1,000"`` -> ``"1000"``; None without one."""
    markers = [m.group(1) for m in _GSM8K_MARKER.finditer(normalize_text(text))]
    if not markers or not markers[-1].strip():
        return None
    answer = _first_sentence(markers[-1]).strip()
    number = _LEADING_NUMBER.match(answer.rstrip(" ."))
    if number:
        return number.group(1).replace(",", "")
    return answer.replace("$", "").strip() or None
