"""``asyncrl train-draft``: an EAGLE draft head for the policy, trained on the policy's own samples.

    asyncrl train-draft quickstart draft.output=heads/v0                       # the tiny warm start
    asyncrl train-draft model.path=RUN/checkpoints/step_400 draft.init=heads/v0 draft.output=heads/v400

1. The engine samples ``draft.prompts`` task prompts (``rollout.n`` samples each, at the rollout's
   temperature / top-p / top-k / max_tokens): the sequences the head will draft for.
2. ``training/draft_head.py`` trains the head on them against the frozen policy's features and
   next-token distributions (``draft.steps``, ``draft.passes`` chained drafts); ``draft.init``
   starts from an earlier head (a refresh after the policy moved: fewer steps suffice).
3. The head is written to ``draft.output`` (config.json + model.safetensors) with
   ``train_draft.json``: its training metrics and, on ``draft.eval_prompts`` held-out prompts, the
   acceptance rate and tokens per target pass of the trained head, the untrained (or ``init``)
   head and n-gram drafting, all in the same run.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from asyncrl.config_schema import ConfigError, to_dict
from asyncrl.data.sources import build_prompt_source
from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.spec.eagle_head import is_head_dir, load_head, new_head
from asyncrl.metrics.console import console
from asyncrl.runtime.pipeline import prepare_policy
from asyncrl.training.checkpoint import write_atomic_text
from asyncrl.training.draft_head import DraftSample, train_head
from asyncrl.training.model import resolve_device
from asyncrl.types import SamplingParams


def rollout_params(cfg, seed: int) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                          seed=seed)


def policy_samples(policy, prompts: list[list[int]], params: SamplingParams, device) -> list[DraftSample]:
    """The engine's samples of ``prompts`` from the in-memory ``policy`` (an HF module)."""
    from asyncrl.engine import LLM

    llm = LLM(policy, dtype=next(policy.parameters()).dtype, device=str(device))
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.close()
    return [DraftSample(list(o.prompt_token_ids) + list(c.token_ids), len(o.prompt_token_ids))
            for o in outs for c in o.outputs]


def acceptance(policy, prompts: list[list[int]], params: SamplingParams, specs: dict[str, dict], device) -> dict:
    """Per drafter (name -> ``speculative_config``): acceptance rate and tokens per target pass of
    ``policy`` generating ``prompts``, every drafter on the same prompts and seeds."""
    from asyncrl.engine import LLM

    out = {}
    # all admitted at once, the speed gate off (spec/adaptive.py): every step speculates, every position is measured
    batch = len(prompts) * params.n
    for name, spec in specs.items():
        llm = LLM(policy, dtype=next(policy.parameters()).dtype, device=str(device), max_num_seqs=max(batch, 16),
                  speculative_config={"disable_by_batch_size": max(batch, 16), **spec, "adaptive": False})
        try:
            llm.generate(prompts, params)
            m = llm.metrics
        finally:
            llm.close()
        out[name] = {"acceptance_rate": m["spec_acceptance_rate"], "tokens_per_target_pass":
                     m["spec_tokens_per_target_pass"], "drafted": m["spec_draft_tokens"]}
    return out


def run_train_draft(cfg) -> dict:
    """Train, write ``draft.output``, report; returns the ``train_draft.json`` record."""
    d = cfg.draft
    if d.init and not is_head_dir(d.init):  # before any model loads
        raise ConfigError(f"draft.init={d.init} is not an EAGLE head checkpoint (no config.json with an "
                          "'eagle_head' block): give a directory written by asyncrl train-draft")
    device = resolve_device(cfg.trainer.device)
    torch.set_num_threads(cfg.trainer.torch_threads)
    source = build_prompt_source(cfg)
    try:
        policy, tokenizer, info = prepare_policy(cfg, source.task, device)
        encode = source.prompt_encoder(tokenizer)
        train_prompts = encode.batch(list(itertools.islice(source.train_stream(), d.prompts)))
        held = encode.batch(source.heldout_examples()[:d.eval_prompts])
    finally:
        source.close()
    console.print(f"train-draft: sampling {len(train_prompts)} prompts x {cfg.rollout.n} from the policy...")
    samples = policy_samples(policy, train_prompts, rollout_params(cfg, cfg.seed), device)
    target = ModelConfig.from_module(policy)
    head = load_head(d.init) if d.init else new_head(target, seed=cfg.seed, init=d.head_init)
    head.check_target(target)
    before = Path(d.output) / "initial"
    head.save(str(before))  # the starting head (untrained, or draft.init), for the same-run comparison
    head.to(device)
    console.print(f"train-draft: {d.steps} steps on {len(samples)} samples ({d.passes} passes)...")
    metrics = train_head(head, policy, samples, d.steps, d.batch_size, d.lr, d.passes, seed=cfg.seed,
                         on_step=_progress(d.steps), label=d.label)
    head.save(d.output, policy=str(info.get("model_path", "")), samples=len(samples), steps=d.steps,
              passes=d.passes, init=d.init)
    record = {"output": d.output, "policy": str(info.get("model_path", "")), "samples": len(samples),
              "train": metrics, "config": to_dict(d)}
    if held:
        k = d.num_speculative_tokens
        specs = {"eagle": {"method": "eagle", "model": d.output, "num_speculative_tokens": k},
                 "eagle_before_training": {"method": "eagle", "model": str(before), "num_speculative_tokens": k},
                 "ngram": {"method": "ngram", "num_speculative_tokens": k}}
        record["acceptance"] = {
            name: acceptance(policy, held, params, specs, device)
            for name, params in (("greedy", SamplingParams(temperature=0, max_tokens=cfg.rollout.max_tokens)),
                                 ("sampled", rollout_params(cfg, cfg.seed + 1)))}
        _print_acceptance(record["acceptance"])
    write_atomic_text(Path(d.output) / "train_draft.json", json.dumps(record, indent=2))
    console.print(f"train-draft: head written to {d.output} (use rollout.speculative.method=eagle "
                  f"rollout.speculative.model={d.output})")
    return record


def _progress(steps: int):
    every = max(1, steps // 10)

    def on_step(step: int, m: dict) -> None:
        if step % every == 0 or step == steps - 1:
            agree = " ".join(f"{m[k]:.2f}" for k in sorted(m) if k.startswith("agree_"))
            console.print(f"  step {step + 1}/{steps} loss {m['loss']:.3f} argmax agreement per draft: {agree}")
    return on_step


def _print_acceptance(acc: dict) -> None:
    for mode, rows in acc.items():
        for name, m in rows.items():
            console.print(f"  {mode:<8} {name:<22} acceptance {m['acceptance_rate']:.3f}  "
                          f"tokens/target pass {m['tokens_per_target_pass']:.3f}")
