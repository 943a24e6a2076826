"""Prompt templates: a format string over row fields, then the model's chat template.

    row ──PromptTemplate──► user text ──ChatTemplate (tokenizer.apply_chat_template)──► prompt

``PromptTemplate`` is plain ``str.format`` (``"{question}\\nPut the answer in \\\\boxed{{}}."``),
so users need no new syntax; ``ChatTemplate`` defers to the tokenizer's own Jinja
template, which is the only way to match what the model saw in training (system
prompt, special tokens, generation prompt).
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Optional, Union


class TemplateError(ValueError):
    """A template refers to something the row or the tokenizer does not have."""


@dataclass(frozen=True)
class PromptTemplate:
    """A Python format string over a row's fields."""

    template: str

    @property
    def fields(self) -> list[str]:
        """The field names the template uses (for validation before training)."""
        names = [name for _, name, _, _ in string.Formatter().parse(self.template) if name]
        return [name.split(".")[0].split("[")[0] for name in names]

    def render(self, row: dict[str, Any]) -> str:
        try:
            return self.template.format(**row)
        except KeyError as err:
            raise TemplateError(f"prompt template uses field {err.args[0]!r}, which the row lacks "
                                f"(fields: {', '.join(sorted(row))})") from None
        except (IndexError, ValueError) as err:
            raise TemplateError(f"bad prompt template {self.template!r}: {err}") from None


class ChatTemplate:
    """Wraps a user message (and optional system prompt) with the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, system_prompt: Optional[str] = None,
                 add_generation_prompt: bool = True, **template_kwargs: Any):
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
            raise TemplateError(f"tokenizer {name!r} has no chat_template; use a plain PromptTemplate "
                                "(a base model) or set tokenizer.chat_template")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.add_generation_prompt = add_generation_prompt
        # e.g. enable_thinking=False for Qwen3's template
        self.template_kwargs = template_kwargs

    def messages(self, user_text: str) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": user_text}]

    def render(self, user_text: str) -> str:
        """The full prompt text, ending with the assistant turn's opening."""
        return self.tokenizer.apply_chat_template(
            self.messages(user_text), tokenize=False,
            add_generation_prompt=self.add_generation_prompt, **self.template_kwargs)

    def token_ids(self, user_text: str) -> list[int]:
        """The prompt's token ids, tokenized once by the template (no second BOS)."""
        ids = self.tokenizer.apply_chat_template(
            self.messages(user_text), tokenize=True,
            add_generation_prompt=self.add_generation_prompt, **self.template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)


def build_prompt(user_text: str, chat: Optional[Union[ChatTemplate, Any]] = None) -> str:
    """``user_text`` through the chat template when there is one, else unchanged."""
    return chat.render(user_text) if chat is not None else user_text
