"""PolicyClient: the OpenAI chat surface over exact token recording (scripted generator)."""
from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.data.chat_render import render_ids
from asyncrl.data.tool_calls import build_tool_parser
from asyncrl.types import Completion, SamplingParams
from asyncrl.workflows.client import ConversationMismatch, PolicyClient
from asyncrl.workflows.tools import CALCULATOR
from tests.serve.chat_fixtures import chat_tokenizer

TOOLS = [CALCULATOR.openai_tool]
REPLIES = {"qwen3": ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>', "42"],
           "llama3": ['{"name": "calculator", "parameters": {"expression": "6*7"}}', "42"]}


class ScriptedGenerator:
    """Replies with fixed texts, tokenized canonically and ended by EOS, logprob -0.5 each."""

    version = 3

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    async def generate(self, prompt_ids, params, session_id):
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(ids, self.tokenizer.decode(ids, skip_special_tokens=True), [-0.5] * len(ids), "stop",
                          [self.version] * len(ids))


async def _episode(client):
    messages = [{"role": "user", "content": "What is 6*7?"}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments) == {"expression": "6*7"}
    messages += [message, *await client.call_tools(message)]
    assert messages[-1]["content"] == "42"
    final = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert final.choices[0].message.content == "42"
    return messages + [final.choices[0].message]


@pytest.mark.parametrize("fmt", ["qwen3", "llama3"])
def test_tokens_are_recorded_as_sampled_and_match_the_whole_rendering(fmt, tmp_path):
    """Each turn's prompt is the previous context + the continuation; sampled ids carry the loss;
    with canonical replies the transcript equals rendering the whole conversation at once
    (the template sanity check of USERS.md item 8)."""
    tok = chat_tokenizer(fmt, tmp_path)
    gen = ScriptedGenerator(tok, REPLIES[fmt])
    client = PolicyClient(gen, tok, SamplingParams(temperature=1.0, max_tokens=64), "s1",
                          build_tool_parser("auto", tok), max_total_tokens=4096)
    client.tools = {"calculator": CALCULATOR}
    conversation = asyncio.run(_episode(client))
    traj = client.trajectory(reward=1.0)
    assert gen.prompts[1] == traj.context[:len(gen.prompts[1])]
    assert gen.prompts[1][:len(gen.prompts[0])] == gen.prompts[0]
    whole = render_ids(tok, conversation, TOOLS, add_generation_prompt=False)
    assert whole[:len(traj.context)] == traj.context  # the whole rendering adds only the closing newline
    assert tok.decode(whole[len(traj.context):]).strip() == ""
    sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    replies = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in REPLIES[fmt]]
    assert sampled == replies[0] + replies[1]
    assert [v for v, m in zip(traj.versions, traj.loss_mask) if not m] == [-1] * (len(traj.loss_mask) - len(sampled))
    assert set(v for v, m in zip(traj.versions, traj.loss_mask) if m) == {3}
    assert traj.info == {"turns": 2, "tool_calls": 1, "session_id": "s1"}


def test_history_rewrites_and_other_temperatures_are_refused(tmp_path):
    tok = chat_tokenizer("qwen3", tmp_path)
    client = PolicyClient(ScriptedGenerator(tok, ["a", "b", "c"]), tok, SamplingParams(temperature=1.0), "s",
                          max_total_tokens=4096)

    async def run():
        first = [{"role": "user", "content": "hi"}]
        reply = await client.chat.completions.create(model="m", messages=first)
        with pytest.raises(ConversationMismatch):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "other"},
                                                                      reply.choices[0].message,
                                                                      {"role": "user", "content": "x"}])
        with pytest.raises(ValueError, match="temperature"):
            await client.chat.completions.create(model="m", messages=first + [reply.choices[0].message,
                                                                              {"role": "user", "content": "x"}],
                                                 temperature=0.2)
    asyncio.run(run())
