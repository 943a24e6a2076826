"""OpenAI-style messages through the model's own chat template, as token ids.

Two uses:

* :func:`render_ids` — a whole conversation (+ tools) to prompt ids, for ``/v1/chat/completions``
  and for the first turn of an episode;
* :func:`continuation_ids` — the tokens that follow an assistant turn the engine generated:
  the template's turn-closing text and the new tool / user messages, rendered *without*
  re-rendering the conversation so far. Chat templates are not append-only (Qwen3 drops the
  thinking of earlier turns, a re-tokenized answer may split differently than sampled), so an
  RL trajectory must keep the sampled ids and append only this continuation
  (USERS.md item 8; verl#6501, verifiers#476).

The continuation is read off the template itself: render a fixed stand-in conversation
``[user, assistant]`` with and without the new messages; the difference is the new messages'
text, and what follows the stand-in assistant's content is the turn-closing glue
(``<|im_end|>\\n`` for Qwen, ``<|eot_id|>`` for Llama 3).
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from asyncrl.data.templates import TemplateError

_STAND_IN_USER = "asyncrl stand-in question"
_STAND_IN_ANSWER = "asyncrl stand-in answer"


def _as_dict(message: Any) -> dict:
    """A message as a plain dict (the openai client's pydantic objects included)."""
    if hasattr(message, "model_dump"):
        return message.model_dump(exclude_none=True)
    if not isinstance(message, dict):
        raise TemplateError(f"a chat message must be a mapping with 'role', got {type(message).__name__}")
    return dict(message)


def _content_text(content: Any) -> Any:
    """OpenAI content parts ``[{"type": "text", "text": ...}]`` joined into one string."""
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) != len(content):
            raise TemplateError("only text content parts are supported")
        return "".join(texts)
    return content


def normalize_messages(messages: Iterable[Any]) -> list[dict]:
    """Messages as templates expect them: dicts, text content, tool-call arguments as dicts
    (the API carries them as JSON strings; Llama's template writes ``arguments | tojson``)."""
    out = []
    for raw in messages:
        msg = _as_dict(raw)
        if "role" not in msg:
            raise TemplateError(f"a chat message needs a 'role': {msg!r}")
        if "content" in msg:
            msg["content"] = _content_text(msg["content"])
        calls = []
        for call in msg.get("tool_calls") or []:
            call = _as_dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass  # left as the model wrote it
            calls.append({**call, "function": fn})
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _template_kwargs(tools: Optional[list], kwargs: Optional[dict]) -> dict:
    extra = dict(kwargs or {})
    if tools:
        extra["tools"] = tools
    return extra


def render_text(tokenizer, messages: list[dict], tools: Optional[list] = None,
                add_generation_prompt: bool = True, template_kwargs: Optional[dict] = None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the model's tokenizer has no chat_template: use /v1/completions")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **_template_kwargs(tools, template_kwargs))
    except Exception as err:  # jinja raises its own errors (TemplateError, raise_exception(...))
        raise TemplateError(f"chat template failed: {err}") from None


def render_ids(tokenizer, messages: Iterable[Any], tools: Optional[list] = None,
               add_generation_prompt: bool = True, template_kwargs: Optional[dict] = None) -> list[int]:
    """Prompt ids of a conversation, tokenized from the template's text with no added special
    tokens (the template writes BOS itself when the model wants one)."""
    text = render_text(tokenizer, normalize_messages(messages), tools, add_generation_prompt, template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def continuation_ids(tokenizer, new_messages: Iterable[Any], tools: Optional[list] = None,
                     ended_with_eos: bool = True, eos_token_ids: Iterable[int] = (),
                     template_kwargs: Optional[dict] = None) -> list[int]:
    """Ids to append after a generated assistant turn so the transcript continues with
    ``new_messages`` and the generation prompt, as the template would write it.

    ``ended_with_eos``: the turn's last sampled token is an end-of-turn token (then the
    template's closing token is already there and is not repeated); otherwise (cut by
    ``max_tokens`` or a stop string) the closing glue is appended whole."""
    base = [{"role": "user", "content": _STAND_IN_USER}, {"role": "assistant", "content": _STAND_IN_ANSWER}]
    new = normalize_messages(new_messages)
    head = render_text(tokenizer, base, tools, add_generation_prompt=False, template_kwargs=template_kwargs)
    full = render_text(tokenizer, base + new, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
    if not full.startswith(head):
        raise TemplateError("the chat template is not append-only after an assistant turn; "
                            "asyncrl cannot continue the conversation without re-rendering it")
    glue = head[head.rindex(_STAND_IN_ANSWER) + len(_STAND_IN_ANSWER):]
    glue_ids = list(tokenizer.encode(glue, add_special_tokens=False))
    if ended_with_eos and glue_ids and glue_ids[0] in set(eos_token_ids):
        glue_ids = glue_ids[1:]  # the sampled end-of-turn token closes the turn already
    return glue_ids + list(tokenizer.encode(full[len(head):], add_special_tokens=False))
