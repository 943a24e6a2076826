"""Tool calls in a model's own output format: parse them out of generated text.

Two formats cover the models asyncrl's engine runs (the names are vLLM's ``--tool-call-parser``):

* ``hermes`` — Qwen2.5 / Qwen3 (and Hermes): each call is a JSON object between tags,
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``; text before the first
  tag is the message content.
* ``llama3_json`` — Llama 3.1 / 3.2 / 3.3 JSON tool calling: the whole message is a JSON
  object ``{"name": "f", "parameters": {...}}`` (several separated by ``;``), optionally after
  ``<|python_tag|>``.

Text that does not parse as a call stays content (as vLLM does): a malformed call is the
policy's mistake, visible to the agent loop, never a server error.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ToolCall:
    """One call: ``arguments`` is a JSON string, as in the OpenAI API."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    content: Optional[str]
    tool_calls: list[ToolCall]


def _call(obj, args_key: str) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5 / Qwen3 chat templates)."""

    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedMessage:
        if self.start not in text:
            return ParsedMessage(text, [])
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedMessage(text, [])  # one malformed block: the whole text is content
            calls.append(call)
        content = text[:text.index(self.start)].strip()
        return ParsedMessage(content or None, calls)

    def may_start_call(self, text: str) -> int:
        """Index from which streamed text must be held back (a call may be starting there)."""
        i = text.find(self.start)
        if i >= 0:
            return i
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):  # a partial tag at the end
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser:
    """A JSON object (or several joined by ``;``) as the whole message (Llama 3.x)."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedMessage:
        body = text.strip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].strip()
        if not body.startswith("{"):
            return ParsedMessage(text, [])
        calls = []
        for part in _split_objects(body):
            try:
                call = _call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedMessage(text, [])
            calls.append(call)
        return ParsedMessage(None, calls)

    def may_start_call(self, text: str) -> int:
        """0 while the message may still turn out to be a call (it opens with ``{`` or the tag)."""
        head = text.lstrip()[:len(self.tag)]
        starts = head.startswith("{") or (bool(head) and self.tag.startswith(head)) or head == self.tag
        return 0 if starts or not head else len(text)


def _split_objects(body: str) -> list[str]:
    """``{..}; {..}`` -> the objects (a ``;`` inside a string is not a separator)."""
    parts, depth, start, in_str, escape = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip()]


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def detect_tool_parser(tokenizer) -> Optional[str]:
    """The format the tokenizer's chat template writes tool calls in; None if it has none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def build_tool_parser(name: str, tokenizer=None):
    """``auto`` (from the chat template), ``hermes``, ``llama3_json``, or ``none`` (returns None)."""
    if name == "auto":
        name = detect_tool_parser(tokenizer) or "none"
    if name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r} (known: auto, none, {', '.join(PARSERS)})")
    return PARSERS[name]()
