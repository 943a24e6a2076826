"""OpenAI response bodies (plain dicts) built from engine completions.

Shared by the HTTP server and the in-process workflow client (which validates the same
dicts into the ``openai`` package's own types), so both return exactly the same thing.

Log-probs are those of the sampled tokens under the distribution actually sampled (after
temperature / top-k / top-p), which is what an RL trainer compares against; OpenAI's are the
model's raw ones (equal at temperature 1 without truncation). Every sampled token is listed,
the end-of-turn token included, so ``token_ids`` / ``logprobs`` / ``token_versions`` align.
"""
from __future__ import annotations

import time
import uuid
from typing import Optional

from asyncrl.types import Completion

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's own text (special tokens written out, as the API lists them)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[float], offset: int = 0) -> dict:
    tokens = token_texts(tokenizer, token_ids)
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[float]) -> dict:
    return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
                        for text, lp in zip(token_texts(tokenizer, token_ids), logprobs)]}


def extension_fields(token_ids: list[int], versions: list[int]) -> dict:
    """asyncrl's per-choice extension: the sampled ids and the policy version of each."""
    return {"token_ids": list(token_ids), "token_versions": list(versions)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, c: Completion, tokenizer, want_logprobs: bool, return_ids: bool) -> dict:
    choice = {"index": index, "text": c.text, "finish_reason": FINISH_REASONS.get(c.finish_reason, c.finish_reason),
              "logprobs": completion_logprobs(tokenizer, c.token_ids, c.logprobs or []) if want_logprobs else None}
    if return_ids:
        choice.update(extension_fields(c.token_ids, c.versions))
    return choice


def chat_message(text: str, parser, tools_active: bool) -> tuple[dict, bool]:
    """(assistant message, has tool calls): tool calls parsed in the model's own format."""
    if parser is not None and tools_active:
        parsed = parser.parse(text)
        if parsed.tool_calls:
            return ({"role": "assistant", "content": parsed.content,
                     "tool_calls": [call.to_openai() for call in parsed.tool_calls]}, True)
    return {"role": "assistant", "content": text}, False


def chat_choice(index: int, c: Completion, tokenizer, parser, tools_active: bool, want_logprobs: bool,
                return_ids: bool) -> dict:
    message, called = chat_message(c.text, parser, tools_active)
    finish = "tool_calls" if called and c.finish_reason == "stop" else FINISH_REASONS.get(c.finish_reason,
                                                                                          c.finish_reason)
    choice = {"index": index, "message": message, "finish_reason": finish,
              "logprobs": chat_logprobs(tokenizer, c.token_ids, c.logprobs or []) if want_logprobs else None}
    if return_ids:
        choice.update(extension_fields(c.token_ids, c.versions))
    return choice


def response_body(kind: str, request_id: str, model: str, choices: list[dict], prompt_tokens: int,
                  completion_tokens: int, prompt_token_ids: Optional[list] = None) -> dict:
    """``kind``: "text_completion" or "chat.completion"."""
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = prompt_token_ids
    return body
