"""Calculator tool use: multiply two 2-3 digit numbers, which the tiny model cannot do in
its head but can by calling the ``calculator`` tool and copying the result.

An episode (``asyncrl.workflows.library.calculator_agent``, chat format below):

    <bos>123*456=                                                   prompt
    <tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call><eos>   sampled
    <tool_response>56088</tool_response>                            inserted (no loss)
    56088<eos>                                                      sampled

The tokenizer is per character plus single tokens for the tool tags and the fixed JSON
around the expression (a BPE tokenizer would also spend few tokens on that boilerplate).
The SFT warm start demonstrates the tool call in ``tool_share`` of its examples and a direct
answer (the true product) in the rest, so the warm-started policy calls the tool in about that
share of its sampled episodes and guesses in the others; RL has to discover that calling pays.
A demonstration's tool output is read, not trained on (``SEGMENTS``): the model learns to call
and to copy the result, never to predict the product. The reward is 1 for the exact product,
ended by EOS, in the final message.
"""
from __future__ import annotations

import random
from pathlib import Path

from asyncrl.data.demonstrations import SEGMENTS
from asyncrl.data.tasks.base import SyntheticTask
from asyncrl.types import Example

CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_HEAD, CALL_TAIL]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{{ m.content }}="
    "{% elif m.role == 'assistant' %}{% if m.content %}{{ m.content }}{% endif %}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}{{ eos_token }}"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{% endif %}{% endfor %}")


class CalculatorTask(SyntheticTask):
    name = "calculator"

    def __init__(self, seed: int = 0, num_eval: int = 200, min_digits: int = 2, max_digits: int = 3,
                 tool_share: float = 0.2):
        self.min_digits, self.max_digits, self.tool_share = min_digits, max_digits, tool_share
        # the suffix keys the warm-start cache (the tokenizer and template are this task's own)
        self.charset = "0123456789*=" + f"|calculator-chat-v2|tools{tool_share}"
        super().__init__(seed, num_eval)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (digits - 1), 10 ** digits - 1)

    def sample(self, rng: random.Random) -> Example:
        a, b = self._operand(rng), self._operand(rng)
        prompt, answer = f"{a}*{b}", str(a * b)
        return Example(prompt=prompt, answer=answer, fields={"answer": answer}, uid=prompt)

    def score(self, response: str, answer: str = "", finish_reason: str = "stop", **_) -> float:
        """The final message is exactly the product, ended by EOS."""
        return float(isinstance(response, str) and finish_reason == "stop" and response.strip() == str(answer))

    def build_tokenizer(self, directory: Path):
        """Characters + the tool tokens + the chat template, saved and loaded back."""
        from transformers import AutoTokenizer

        from asyncrl.data.char_tokenizer import build_char_tokenizer

        tok = build_char_tokenizer("0123456789*=")
        tok.add_tokens(TOOL_TOKENS)  # plain added tokens: decoding keeps them (the parser reads them)
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(str(directory))
        return AutoTokenizer.from_pretrained(str(directory))

    def demonstrations(self, seed: int):
        """SFT examples in the chat format: prompt = the rendered first turn (the tokenizer adds
        BOS), answer = the rest of the transcript (the trainer appends the final EOS)."""
        rng = random.Random(f"{self.seed}-sft-{seed}")
        for ex in self.train_stream(seed):
            if rng.random() < self.tool_share:
                segments = [(f"<tool_call>{CALL_HEAD}{ex.prompt}{CALL_TAIL}</tool_call><eos>", True),
                            (f"<tool_response>{ex.answer}</tool_response>", False),  # the tool writes it
                            (ex.answer, True)]
            else:
                segments = [(ex.answer, True)]
            answer = "".join(text for text, _ in segments)
            yield Example(prompt=f"{ex.prompt}=", answer=answer, fields={**ex.fields, SEGMENTS: segments}, uid=ex.uid)
