"""Tiny chat checkpoints for the server and workflow tests: a character tokenizer plus the
chat-template tokens of Qwen3 (ChatML + hermes tool calls) or Llama 3.1 (header ids + JSON tool
calls), and a 2-layer Qwen3 model, optionally fitted to answer one conversation exactly.

The templates are compact re-writings of those models' formats (the official files are not
shipped with any package here): same special tokens, same tool-call and tool-result layout.
"""
from __future__ import annotations

import string
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from asyncrl.data.char_tokenizer import build_char_tokenizer
from asyncrl.data.chat_render import render_ids
from asyncrl.training.logprobs import response_logprobs

QWEN3_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tc in message.tool_calls or [] %}{% if not loop.first or message.content %}
{% endif %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}Cutting Knowledge Date: December 2023

{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>
{%- set first_user = namespace(done=false) %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'user' %}<|start_header_id|>user<|end_header_id|>

{% if tools and not first_user.done %}Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{% endif %}{%- set first_user.done = true %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>

{% if message.tool_calls %}{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}{% else %}{{ message.content }}{% endif %}<|eot_id|>
{%- elif message.role == 'tool' or message.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

FORMATS = {
    "qwen3": dict(template=QWEN3_TEMPLATE, eos="<|im_end|>", special=["<|im_start|>", "<|im_end|>"],
                  plain=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "llama3": dict(template=LLAMA3_TEMPLATE, eos="<|eot_id|>",
                   special=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                            "<|python_tag|>"], plain=[]),
}
CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"


def chat_tokenizer(fmt: str, directory: Path):
    """A character tokenizer with the format's special tokens and chat template, saved and
    loaded back through ``AutoTokenizer``."""
    spec = FORMATS[fmt]
    tok = build_char_tokenizer(CHARSET)
    tok.add_special_tokens({"additional_special_tokens": spec["special"]})
    tok.add_tokens(spec["plain"])  # Qwen's tool tags are plain added tokens: decode keeps them
    tok.eos_token = spec["eos"]
    tok.chat_template = spec["template"]
    tok.save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def tiny_model(tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2, max_len: int = 1024):
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_len, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def fit_reply(model, tokenizer, messages, tools, reply: str, steps: int = 400, lr: float = 1e-2) -> float:
    """Train ``model`` until greedy decoding of the conversation gives ``reply`` + EOS (every
    target token above probability 0.7, so it is the argmax); returns the smallest target
    log-prob (a one-example overfit, seconds on CPU)."""
    prompt = render_ids(tokenizer, messages, tools)
    answer = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + answer])
    mask = torch.ones_like(ids)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        lp, _ = response_logprobs(model, ids, mask, len(prompt))
        if lp.min().item() > -0.35:
            break
        opt.zero_grad()
        (-lp.mean()).backward()
        opt.step()
    model.eval()
    return lp.min().item()


def save_checkpoint(model, tokenizer, directory: Path) -> Path:
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return directory
