"""The CPU quickstart's rollout, engine vs HF generate, in one run.

The model, tokenizer, prompts and sampling parameters are the ones ``asyncrl train``
(the quickstart recipe) uses: the 0.79M Qwen3 from ``prepare_policy`` (the cached SFT warm
start; trained first if the cache is empty) or, with ``random_weights``, the same model
built by ``build_tiny_model`` before SFT. Each rollout is what the sync controller calls
once per step: ``backend.generate(16 prompt id lists, SamplingParams(n=8, T=1.0,
max_tokens=6, logprobs=True, seed=...))``, through the two rollout backends the
registry builds (``engine`` and ``hf``). The two backends alternate, rollout by rollout,
on the same prompts, so load changes on a shared machine hit both alike; the numbers are
medians.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from itertools import islice

import torch

from asyncrl.types import SamplingParams


def _policy(cfg, task, random_weights: bool):
    """(model, tokenizer, description) built as the quickstart builds them."""
    from asyncrl.runtime.pipeline import prepare_policy

    if not random_weights:
        model, tokenizer, info = prepare_policy(cfg, task, torch.device("cpu"), announce=False)
        return model.eval(), tokenizer, f"SFT warm start {info['model_path']}"
    from asyncrl.data.char_tokenizer import build_char_tokenizer, save_and_reload
    from asyncrl.training.model import build_tiny_model

    tokenizer = save_and_reload(build_char_tokenizer(task.charset), tempfile.mkdtemp(prefix="asyncrl-qs-tok-"))
    tokenizer.padding_side = "left"
    model = build_tiny_model(cfg.model.tiny, tokenizer, cfg.seed)
    return model.eval(), tokenizer, "random weights (build_tiny_model, seed 0, no SFT)"


def run_quickstart_rollout(repeats: int = 40, random_weights: bool = False, recipe: str = "quickstart") -> dict:
    """Median ms per rollout for the engine and HF generate, interleaved; returns a dict."""
    from asyncrl.config import load_config
    from asyncrl.data.sources import build_prompt_source
    from asyncrl.rollout.registry import build_backend

    cfg = load_config(recipe)
    torch.set_num_threads(cfg.trainer.torch_threads)
    source = build_prompt_source(cfg)
    model, tokenizer, what = _policy(cfg, source.task, random_weights)
    encode = source.prompt_encoder(tokenizer)
    stream = source.train_stream()
    r = cfg.rollout
    backends = {name: build_backend(name, model, tokenizer) for name in ("engine", "hf")}
    times = {name: [] for name in backends}
    tokens = {name: 0 for name in backends}
    for i in range(repeats + 2):  # the first two rounds warm both up and are not counted
        prompts = [encode(ex) for ex in islice(stream, cfg.trainer.prompts_per_step)]
        params = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_tokens=r.max_tokens, logprobs=True, seed=cfg.seed * 1_000_003 + i)
        order = list(backends) if i % 2 == 0 else list(reversed(backends))
        for name in order:
            t0 = time.perf_counter()
            outs = backends[name].generate(prompts, params)
            dt = time.perf_counter() - t0
            if i >= 2:
                times[name].append(dt)
                tokens[name] += sum(len(c.token_ids) for o in outs for c in o.completions)
    ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
    source.close()
    return dict(
        workload=f"{recipe}: {cfg.trainer.prompts_per_step} prompts x n={r.n}, max_tokens={r.max_tokens}, "
                 f"T={r.temperature}, torch_threads={cfg.trainer.torch_threads}",
        model=what, repeats=repeats, load_avg=os.getloadavg(),
        engine_ms_per_rollout=round(ms["engine"], 2), hf_ms_per_rollout=round(ms["hf"], 2),
        engine_tokens_per_rollout=round(tokens["engine"] / repeats, 1),
        hf_tokens_per_rollout=round(tokens["hf"] / repeats, 1),
        speedup=round(ms["hf"] / ms["engine"], 2))
