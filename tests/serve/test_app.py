"""The official ``openai`` client against ``asyncrl serve`` (a tiny model on a loopback port)."""
from __future__ import annotations

import asyncio
import io
import json

import httpx
import openai
import pytest
import torch
from safetensors.torch import save

from tests.serve.conftest import API_KEY, QUESTION, TOOLS, serve


def client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_models_and_health(qwen_server):
    url, _ = qwen_server
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["version"] == 0 and health["engine"]["steps"] >= 0
    refused = httpx.get(url + "/v1/models")  # no key: the API-key middleware answers, OpenAI-shaped
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_completion_logprobs_and_token_ids(qwen_server):
    url, state = qwen_server
    out = client(url).completions.create(model="tiny", prompt="Hello", max_tokens=8, n=2, temperature=1.0,
                                         seed=3, logprobs=1, extra_body={"return_token_ids": True,
                                                                         "ignore_eos": True})
    tok = state.tokenizer
    assert out.prompt_token_ids == tok("Hello")["input_ids"]
    for choice in out.choices:
        assert len(choice.token_ids) == len(choice.logprobs.token_logprobs) == len(choice.token_versions) == 8
        assert choice.token_versions == [0] * 8
        assert choice.text == tok.decode(choice.token_ids, skip_special_tokens=True)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert out.usage.completion_tokens == 16
    # the same request by token ids gives the same tokens (same seed)
    again = client(url).completions.create(model="tiny", prompt=out.prompt_token_ids, max_tokens=8, n=2, seed=3,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]


def test_chat_tool_call(qwen_server):
    url, _ = qwen_server
    out = client(url).chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, temperature=0,
                                              max_tokens=80, logprobs=True)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 12, "b": 30}
    assert len(choice.logprobs.content) == out.usage.completion_tokens
    # tools off: the same text is plain content
    plain = client(url).chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="none",
                                                temperature=0, max_tokens=80)
    assert plain.choices[0].message.tool_calls is None


def test_streaming_equals_non_streaming(qwen_server):
    url, _ = qwen_server
    c = client(url)
    whole = c.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=80)
    calls, content = {}, ""
    for chunk in c.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, temperature=0,
                                           max_tokens=80, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            calls[tc.index] = (tc.function.name, tc.function.arguments)
        finish = chunk.choices[0].finish_reason or None
    expected = whole.choices[0].message.tool_calls[0].function
    assert calls == {0: (expected.name, expected.arguments)} and finish == "tool_calls"
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="Hello", max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert text == c.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text


def test_errors_keep_the_server_serving(qwen_server):
    url, _ = qwen_server
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    bad = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=headers)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(url).completions.create(model="tiny", prompt="hi", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client(url).completions.create(model="tiny", prompt="x" * 1100, max_tokens=4)
    with pytest.raises(openai.APIStatusError) as big:
        client(url).completions.create(model="tiny", prompt="y" * (70 << 10), max_tokens=2)
    assert big.value.status_code == 413
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client(url).completions.create(model="tiny", prompt="hi", max_tokens=2, logit_bias={"5": 1.0})
    assert client(url).completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


def test_concurrent_requests_share_engine_steps(qwen_server):
    """Continuous batching: 8 concurrent 32-token requests take about 32 engine steps, not 8 x 32."""
    url, state = qwen_server

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as c:
            return await asyncio.gather(*(c.completions.create(model="tiny", prompt=f"q{i}", max_tokens=32,
                                                               extra_body={"ignore_eos": True}) for i in range(8)))
    before = httpx.get(url + "/health").json()["engine"]
    outs = asyncio.run(run())
    after = httpx.get(url + "/health").json()["engine"]
    assert all(o.usage.completion_tokens == 32 for o in outs)
    assert after["steps"] - before["steps"] < 2 * 33
    # the engine's counters (/health): 8 x 32 tokens came from shared decode steps
    decode_rows, decode_steps = (after[k] - before[k] for k in ("decode_rows", "decode_steps"))
    assert decode_rows >= 8 * 31 and decode_rows / decode_steps > 4


def test_over_max_concurrent_is_429(fitted_checkpoints):
    with serve(fitted_checkpoints["qwen3"], max_concurrent=1) as url:
        c = client(url)
        stream = c.completions.create(model="tiny", prompt="a", max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model="tiny", prompt="b", max_tokens=2)
        stream.close()


def test_update_weights_sets_version_and_weights(qwen_server, fitted_checkpoints):
    url, state = qwen_server
    c = client(url)
    before = c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, logprobs=1,
                                  extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    llm = state.engine.llm
    from asyncrl.engine.models.loader import iter_safetensors
    weights = dict(iter_safetensors(str(fitted_checkpoints["qwen3"])))
    weights = {k: v * 1.5 if "mlp" in k else v for k, v in weights.items()}
    r = httpx.post(url + "/v1/update_weights", content=save(weights),
                   headers={"Authorization": f"Bearer {API_KEY}", "X-Policy-Version": "7"}, timeout=60)
    assert r.status_code == 200 and r.json()["version"] == 7 and llm.version == 7
    after = c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, logprobs=1,
                                 extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert after.token_versions == [7] * 4
    assert after.logprobs.token_logprobs != before.logprobs.token_logprobs
    bad = httpx.post(url + "/v1/update_weights", content=save({"nope.weight": torch.zeros(2)}),
                     headers={"Authorization": f"Bearer {API_KEY}", "X-Policy-Version": "8"})
    assert bad.status_code == 400

