"""rollout.backend=openai against ``asyncrl serve``: the same tokens as the in-process engine, and
training whose weight pushes reach the server (the engine/trainer log-prob gap stays ~0)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.data.tasks import build_task
from asyncrl.engine import LLM
from asyncrl.rollout.openai_backend import OpenAIBackend
from asyncrl.runtime.pipeline import run_training
from asyncrl.serve.server import BackgroundServer, build_state
from asyncrl.training.warm_start import tiny_checkpoint
from asyncrl.types import Example, SamplingParams
from asyncrl.workflows.backend import WorkflowBackend

KEY = "k"


async def two_completions(client, example):
    """A base-model agent loop: a completion, then the prompt extended by it and "+1="."""
    first = await client.completions.create(model="policy", prompt=example.prompt, max_tokens=4)
    await client.completions.create(model="policy", prompt=example.prompt + first.choices[0].text + "+1=",
                                    max_tokens=4)
    return 1.0


def _check_workflow_over_http(backend, tokenizer):
    """Episodes through the server (HTTPGenerator): sampled ids with the server's versions, the
    inserted text as its own tokens without loss."""
    outs = WorkflowBackend(backend, two_completions, tokenizer).generate_examples(
        [Example(prompt="12+3=", answer="15", uid="a"), Example(prompt="7+8=", answer="15", uid="b")],
        SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=3))
    inserted = tokenizer.encode("+1=", add_special_tokens=False)
    for out in outs:
        for c in out.completions:
            assert c.info["turns"] == 2 and c.reward == 1.0
            masked = [t for t, m in zip(c.token_ids, c.loss_mask) if not m]
            assert masked == inserted
            assert {v for v, m in zip(c.versions, c.loss_mask) if m} == {0}


def _config(tmp_path: Path, url: str, mode: str):
    return load_config("quickstart", [
        "sft.steps=0", f"sft.cache_dir={tmp_path / 'cache'}", "trainer.steps=3", "task.num_eval=8",
        "trainer.eval_samples=0", "trainer.prompts_per_step=4", "rollout.n=4", "actor.lr=0.01",
        "rollout.backend=openai", f"rollout.openai.base_url={url}", f"rollout.openai.api_key={KEY}",
        f"runtime.mode={mode}", "runtime.rollout_process=false", "runtime.probe=false", "trainer.max_wall_seconds=600",
        f"logging.output_dir={tmp_path / mode}", "logging.report=false", "logging.tensorboard=false",
        "logging.progress=false", "model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2",
        "model.tiny.head_dim=8", "model.tiny.intermediate_size=64"])


def test_openai_backend_generates_and_trains_through_asyncrl_serve(tmp_path):
    torch.set_num_threads(1)
    cfg = _config(tmp_path, "http://unused", "sync")
    checkpoint, _ = tiny_checkpoint(cfg, build_task(cfg.task, cfg.seed), "cpu")  # what the trainer will build
    state = build_state(str(checkpoint), served_name="policy", api_key=KEY, device="cpu", num_kv_blocks=128,
                        block_size=16)
    with BackgroundServer(state) as url:
        backend = OpenAIBackend(url, "policy", KEY)
        params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=11)
        prompts = [[1, 5, 6, 4], [1, 7, 4]]
        local = LLM(str(checkpoint), device="cpu", num_kv_blocks=128, block_size=16).generate(prompts, params)
        for client in ("aiohttp", "httpx"):  # the default (aiohttp, installed here) and the fallback
            remote = OpenAIBackend(url, "policy", KEY, http_client=client).generate(prompts, params)
            for r, l in zip(remote, local):
                assert [c.token_ids for c in r.completions] == [c.token_ids for c in l.completions]
                for rc, lc in zip(r.completions, l.completions):
                    assert max(abs(a - b) for a, b in zip(rc.logprobs, lc.logprobs)) < 1e-6
                    assert rc.versions == [0] * len(rc.token_ids)
        _check_workflow_over_http(backend, state.tokenizer)
        for mode in ("sync", "async"):
            cfg = _config(tmp_path, url, mode)
            if mode == "async":
                cfg.algorithm.decoupled = True
            summary = run_training(cfg)
            rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
            assert len(rows) == 3
            # lr 0.01 moves log-probs by far more than 1e-4 per step: a missed push would show here
            assert all(r["rollout/logprob_gap"] < 1e-4 for r in rows), [r["rollout/logprob_gap"] for r in rows]
            if mode == "sync":
                assert state.engine.version == 3  # one push per update, the server took each


def test_the_http_client_is_aiohttp_when_installed_and_checked_by_name():
    import httpx

    assert not isinstance(OpenAIBackend("http://x", "m").async_client()._client, httpx.AsyncClient)  # auto
    assert isinstance(OpenAIBackend("http://x", "m", http_client="httpx").async_client()._client, httpx.AsyncClient)
    with pytest.raises(ValueError, match="http_client"):
        OpenAIBackend("http://x", "m", http_client="requests")
