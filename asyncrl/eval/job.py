"""``asyncrl eval``: a model (``model.path``: an HF checkpoint, a checkpoint of a run, or a
run directory) on the held-out set of ``data.*`` (or of the synthetic task), through the
rollout backend of ``rollout.backend``, scored by ``reward.*``.

Prints a table and writes ``<run_dir>/eval.json`` (the numbers, the model, the data)
and ``<run_dir>/eval_samples.jsonl`` (every prompt's samples, verdicts and answers).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.table import Table

from asyncrl.config_schema import ConfigError
from asyncrl.data.sources import build_prompt_source
from asyncrl.eval.benchmark import evaluate_examples, result_record, summarize
from asyncrl.metrics.console import console
from asyncrl.runtime.run_dir import make_run_dir, releasing_run_dirs
from asyncrl.training.checkpoint import write_atomic_text
from asyncrl.training.model import (check_model_dir, load_policy, quiet_transformers, resolve_device,  # noqa: F401
                                    resolve_model_path)
from asyncrl.types import SamplingParams
from asyncrl.rollout.registry import resolve_backend_name_for_path


def load_backend(cfg, model_path: Path):
    """(tokenizer, rollout backend named by ``rollout.backend``). The engine loads the
    checkpoint itself, so the weights are not held twice."""
    device = resolve_device(cfg.trainer.device)
    if resolve_backend_name_for_path(cfg.rollout.backend, model_path) == "engine":
        from transformers import AutoTokenizer

        from asyncrl.rollout.engine_backend import EngineBackend
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer, EngineBackend(str(model_path), tokenizer, dtype=getattr(torch, cfg.model.dtype),
                                        device=str(device))
    from asyncrl.rollout.hf import HFGenerateBackend
    model, tokenizer = load_policy(model_path, cfg.model.dtype, device)
    return tokenizer, HFGenerateBackend(model.eval(), tokenizer)


def sampling_params(cfg) -> SamplingParams:
    e = cfg.eval
    return SamplingParams(n=e.k, temperature=e.temperature, top_p=e.top_p,
                          max_tokens=e.max_tokens or cfg.rollout.max_tokens, seed=e.seed, logprobs=False)


def eval_table(numbers: dict[str, float], title: str) -> Table:
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in numbers.items():
        table.add_row(key, str(int(value)) if key == "num_prompts" else f"{value:.4f}")
    return table


@releasing_run_dirs
def run_eval(cfg) -> dict:
    """Run ``asyncrl eval``; returns what ``eval.json`` holds."""
    if not cfg.model.path:
        raise ConfigError("asyncrl eval needs model.path: an HF checkpoint directory, a run's checkpoint, "
                          "or a run directory (its latest checkpoint)")
    model_path = resolve_model_path(cfg.model.path)
    check_model_dir(model_path)  # a missing or truncated file named, before any loader's error or run dir
    source = build_prompt_source(cfg, train=False)
    try:
        return _evaluate(cfg, source, model_path)
    finally:
        source.close()


def _evaluate(cfg, source, model_path: Path) -> dict:
    start = time.perf_counter()
    quiet_transformers()
    torch.set_num_threads(cfg.trainer.torch_threads)
    examples = source.heldout_examples()
    if not examples:
        raise ConfigError("nothing to evaluate: set data.path, data.preset, data.eval_path or data.eval_preset")
    run_dir = make_run_dir(cfg, job="eval")
    console.print(f"[bold]asyncrl eval[/] {model_path} on [cyan]{source.name}[/] ({len(examples)} prompts, "
                  f"k={cfg.eval.k}) -> {run_dir}")
    tokenizer, backend = load_backend(cfg, model_path)
    results = evaluate_examples(backend, source.prompt_encoder(tokenizer), examples, source.heldout_reward,
                                sampling_params(cfg), cfg.eval.batch_size)
    numbers = summarize(results, cfg.eval.k, cfg.eval.metrics)
    report = {"model": str(model_path), "data": source.name, "k": cfg.eval.k,
              "temperature": cfg.eval.temperature, "metrics": numbers,
              "seconds": time.perf_counter() - start, "run_dir": str(run_dir)}
    write_atomic_text(run_dir / "eval.json", json.dumps(report, indent=2))
    write_atomic_text(run_dir / "eval_samples.jsonl", "".join(json.dumps(result_record(r)) + "\n" for r in results))
    console.print(eval_table(numbers, f"{source.name} (k={cfg.eval.k}, T={cfg.eval.temperature})"))
    console.print(f"written: {run_dir / 'eval.json'}")
    return report
