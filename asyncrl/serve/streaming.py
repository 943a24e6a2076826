"""Incremental text for streamed responses (server-sent events).

Text is decoded from all of a sample's ids so far (a token may end mid-character) and sent
as the new suffix, holding back what may still change: the tail that could start a stop
string (cut from the final text), an incomplete UTF-8 character, and, when tools are on,
everything from where a tool call may begin (it is sent parsed, as ``tool_calls``, at the end).
"""
from __future__ import annotations

import json
from typing import Optional


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class TextStreamer:
    """Per-sample text already sent. Invariant: ``sent[i]`` is a prefix of sample i's final text."""

    def __init__(self, tokenizer, n: int, stops: list[str]):
        self.tokenizer = tokenizer
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.sent: list[str] = [""] * n
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def _safe_end(self, text: str) -> int:
        end = len(text) - self.holdback
        while end > 0 and text[end - 1] == "\ufffd":  # an incomplete multi-byte character
            end -= 1
        return end

    def feed(self, index: int, token_ids: list[int]) -> str:
        """New text of sample ``index`` that can be sent now."""
        self.ids[index].extend(token_ids)
        text = self.tokenizer.decode(self.ids[index], skip_special_tokens=True)
        return self._advance(index, text, self._safe_end(text))

    def _advance(self, index: int, text: str, end: int) -> str:
        sent = self.sent[index]
        if end <= len(sent) or not text.startswith(sent):
            return ""
        self.sent[index] = text[:end]
        return text[len(sent):end]

    def finish(self, index: int, final_text: str) -> str:
        """The rest of the final text (stop string cut by the engine)."""
        return self._advance(index, final_text, len(final_text))


class ChatStreamer(TextStreamer):
    """Also holds back text from where a tool call may start; calls are sent parsed at the end."""

    def __init__(self, tokenizer, n: int, stops: list[str], parser=None):
        super().__init__(tokenizer, n, stops)
        self.parser = parser

    def feed(self, index: int, token_ids: list[int]) -> str:
        self.ids[index].extend(token_ids)
        text = self.tokenizer.decode(self.ids[index], skip_special_tokens=True)
        end = self._safe_end(text)
        if self.parser is not None:
            end = min(end, self.parser.may_start_call(text))
        return self._advance(index, text, end)

    def finish_chat(self, index: int, final_text: str) -> tuple[dict, bool]:
        """(the last delta, whether it carries tool calls)."""
        if self.parser is not None:
            parsed = self.parser.parse(final_text)
            if parsed.tool_calls:
                calls = [{"index": k, **call.to_openai()} for k, call in enumerate(parsed.tool_calls)]
                delta: dict = {"tool_calls": calls}
                rest = self._advance(index, parsed.content or "", len(parsed.content or ""))
                if rest:
                    delta["content"] = rest
                return delta, True
        rest = self.finish(index, final_text)
        return ({"content": rest} if rest else {}), False
