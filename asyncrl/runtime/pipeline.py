"""The whole training job: model (+ SFT warm start), held-out eval, RL steps, eval, checkpoint.

This composes the pieces; each piece lives in its own module.
"""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch

from asyncrl.data.tasks import build_task
from asyncrl.eval.accuracy import heldout_accuracy
from asyncrl.metrics.console import StepProgress, console, summary_table
from asyncrl.metrics.sinks import MetricSinks
from asyncrl.rollout.hf import HFGenerateBackend
from asyncrl.runtime.run_dir import make_run_dir
from asyncrl.runtime.sync_controller import build_sync_controller
from asyncrl.training.actor import Actor
from asyncrl.training.checkpoint import save_checkpoint, write_atomic_text
from asyncrl.training.model import load_policy, resolve_device
from asyncrl.training.warm_start import tiny_checkpoint


def prepare_policy(cfg, task, device, announce: bool = True):
    """(model, tokenizer, info): a local checkpoint, or the tiny model warm-started by SFT."""
    if cfg.model.path:
        model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
        return model, tokenizer, {"model_path": cfg.model.path}
    if announce:
        console.print(f"[dim]warm start: tiny Qwen3 + SFT on {task.name} ({cfg.sft.steps} steps)...[/]")
    path, info = tiny_checkpoint(cfg, task, device)
    if announce:
        state = "cached" if info.get("sft/cached") else f"trained in {info.get('sft/seconds', 0):.1f}s"
        console.print(f"[dim]warm start {state}: {path}[/]")
    model, tokenizer = load_policy(path, cfg.model.dtype, device)
    return model, tokenizer, {"model_path": str(path), **info}


def run_training(cfg) -> dict:
    """Run ``asyncrl train``; returns the summary also written to ``summary.json``."""
    wall_start = time.perf_counter()
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.trainer.device)
    run_dir = make_run_dir(cfg)
    console.print(f"[bold]asyncrl[/] run [cyan]{cfg.name}[/] -> {run_dir}")
    task = build_task(cfg.task, cfg.seed)
    model, tokenizer, model_info = prepare_policy(cfg, task, device)
    backend = HFGenerateBackend(model, tokenizer)
    evaluate = lambda: heldout_accuracy(backend, tokenizer, task.reward, task.eval_examples(), cfg.rollout.max_tokens)
    sft_accuracy = evaluate()
    console.print(f"held-out accuracy before RL: [bold]{sft_accuracy:.3f}[/]")
    controller = build_sync_controller(cfg, model, backend, tokenizer, task.reward, task.train_stream(seed=cfg.seed))
    actor = controller.actor
    sinks = MetricSinks(run_dir, cfg.logging.tensorboard)
    steps_done, step_wall, rl_start = 0, 0.0, time.perf_counter()
    try:
        with StepProgress(cfg.trainer.steps, cfg.logging.progress) as progress:
            for step in range(1, cfg.trainer.steps + 1):
                step_start = time.perf_counter()
                metrics = controller.step(step)
                step_wall += time.perf_counter() - step_start  # measured apart from the stage timer
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
                    metrics["eval/accuracy"] = evaluate()
                sinks.write(step, metrics)
                progress.advance(metrics)
                steps_done = step
                if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
                    _checkpoint(run_dir, step, actor, tokenizer, cfg)
                if cfg.trainer.max_wall_seconds and time.perf_counter() - rl_start > cfg.trainer.max_wall_seconds:
                    console.print(f"[yellow]stopping after {step} steps: trainer.max_wall_seconds reached[/]")
                    break
    finally:
        sinks.close()
    rl_seconds = time.perf_counter() - rl_start
    final_accuracy = evaluate()
    checkpoint = _checkpoint(run_dir, steps_done, actor, tokenizer, cfg)
    summary = {
        "name": cfg.name, "seed": cfg.seed, "run_dir": str(run_dir), "steps": steps_done,
        "sft_accuracy": sft_accuracy, "final_accuracy": final_accuracy,
        "accuracy_gain": final_accuracy - sft_accuracy, "rl_seconds": rl_seconds,
        "wall_seconds": time.perf_counter() - wall_start,
        "step_wall_seconds": step_wall, "stage_seconds": dict(controller.timer.total_seconds),
        "checkpoint": str(checkpoint),
        **{k: v for k, v in model_info.items()},
    }
    write_atomic_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    console.print(summary_table(summary))
    console.print(f"held-out accuracy: SFT {sft_accuracy:.3f} -> RL {final_accuracy:.3f} "
                  f"([bold]{100 * (final_accuracy - sft_accuracy):+.1f} points[/])")
    console.print(f"run directory: {run_dir}")
    return summary


def _checkpoint(run_dir: Path, step: int, actor: Actor, tokenizer, cfg) -> Path:
    return save_checkpoint(run_dir, step, actor.model, tokenizer, actor.optimizer, actor.scheduler,
                           {"policy_version": actor.version, "seed": cfg.seed}, keep=cfg.trainer.keep_checkpoints)
