"""A served tiny chat model per tool-call format, fitted to call a tool for one conversation."""
from __future__ import annotations

import pytest
import torch

from asyncrl.serve.limits import ServeLimits
from asyncrl.serve.server import BackgroundServer, build_state
from tests.serve.chat_fixtures import chat_tokenizer, fit_reply, save_checkpoint, tiny_model

API_KEY = "test-key"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
QUESTION = [{"role": "user", "content": "What is 12+30?"}]
REPLIES = {"qwen3": '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>',
           "llama3": '{"name": "add", "parameters": {"a": 12, "b": 30}}'}


@pytest.fixture(scope="session")
def fitted_checkpoints(tmp_path_factory):
    """format -> checkpoint dir of a model that answers QUESTION (with TOOLS) by calling add(12, 30)."""
    torch.set_num_threads(1)
    out = {}
    for fmt, reply in REPLIES.items():
        directory = tmp_path_factory.mktemp(f"chat-{fmt}")
        tokenizer = chat_tokenizer(fmt, directory)
        model = tiny_model(tokenizer)
        fit_reply(model, tokenizer, QUESTION, TOOLS, reply)
        out[fmt] = save_checkpoint(model, tokenizer, directory)
    return out


def serve(checkpoint, **limits):
    state = build_state(str(checkpoint), served_name="tiny", api_key=API_KEY,
                        limits=ServeLimits(**{"max_tokens": 256, "max_concurrent": 64, "max_body_bytes": 64 << 10,
                                              **limits}),
                        device="cpu", num_kv_blocks=256, block_size=16)
    return BackgroundServer(state)


@pytest.fixture(scope="module")
def qwen_server(fitted_checkpoints):
    server = serve(fitted_checkpoints["qwen3"])
    with server as url:
        yield url, server.state
