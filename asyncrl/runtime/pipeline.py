"""The whole training job: model (+ SFT warm start), held-out eval, RL steps, eval, checkpoint.

This composes the pieces; each piece lives in its own module.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from asyncrl.data.sources import build_prompt_source
from asyncrl.eval.accuracy import heldout_accuracy
from asyncrl.metrics.console import StepProgress, console, summary_table
from asyncrl.config_schema import to_dict
from asyncrl.metrics.health import HealthMonitor
from asyncrl.metrics.profile import StageProfile, headline, profile_table
from asyncrl.metrics.sinks import MetricSinks
from asyncrl.rollout.registry import build_backend, engine_options
from asyncrl.runtime.async_controller import build_async_controller
from asyncrl.runtime.run_dir import start_run
from asyncrl.runtime.sync_controller import build_sync_controller
from asyncrl.training.actor import Actor
from asyncrl.runtime.weight_sync import rollout_weights
from asyncrl.training.checkpoint import save_checkpoint, write_atomic_text
from asyncrl.training.lora import apply_lora, save_merged
from asyncrl.training.model import load_policy, resolve_model_path
from asyncrl.training.warm_start import tiny_checkpoint
from asyncrl.workflows.build import wrap_backend


def prepare_policy(cfg, task, device, announce: bool = True):
    """(model, tokenizer, info): a local checkpoint, or the tiny model warm-started by SFT."""
    if cfg.model.path:  # a checkpoint dir, a run dir (its latest checkpoint) or a Hub id
        path = resolve_model_path(cfg.model.path)
        model, tokenizer = load_policy(path, cfg.model.dtype, device)
        return model, tokenizer, {"model_path": str(path)}
    if announce:
        console.print(f"[dim]warm start: tiny {cfg.model.tiny.architecture} + SFT on {task.name} ({cfg.sft.steps} steps)...[/]")
    path, info = tiny_checkpoint(cfg, task, device)
    if announce:
        state = "cached" if info.get("sft/cached") else f"trained in {info.get('sft/seconds', 0):.1f}s"
        console.print(f"[dim]warm start {state}: {path}[/]")
    model, tokenizer = load_policy(path, cfg.model.dtype, device)
    return model, tokenizer, {"model_path": str(path), **info}


def run_training(cfg, source=None) -> dict:
    """Run ``asyncrl train``; returns the summary also written to ``summary.json``.

    The prompt source (synthetic task, or dataset + reward pool; ``source`` when the Python
    API built it from Python objects) is built first, so bad data or reward names fail
    before any model loads; its pool is closed at the end.
    """
    source = source if source is not None else build_prompt_source(cfg)
    try:
        return _train(cfg, source)
    finally:
        source.close()


def _train(cfg, source) -> dict:
    wall_start = time.perf_counter()
    device, run_dir = start_run(cfg, f"[bold]asyncrl[/] run [cyan]{cfg.name}[/]", job="train")
    model, tokenizer, model_info = prepare_policy(cfg, source.task, device)
    if cfg.actor.lora.enabled:  # adapters on the loaded policy: only they train, and only they sync
        model = apply_lora(model, cfg.actor.lora)
    backend = wrap_backend(cfg, build_backend(cfg.rollout.backend, model, tokenizer,
                                              **engine_options(cfg.rollout, cfg.actor.lora)),
                           tokenizer)  # a workflow runs whole episodes on it (asyncrl.workflows)
    encode, heldout = source.prompt_encoder(tokenizer), source.heldout_examples()
    def evaluate(samples: Optional[dict] = None) -> dict:
        """Held-out accuracy: greedy, and mean@k sampled at the rollout temperature, of the
        trainer's current weights. The sync controller pushes them into ``backend`` after each
        update; the async one generates with a backend of its own, so ``backend`` (an engine
        holds its own copy) is refreshed here first — else async runs would evaluate the warm
        start. A no-op copy for HF generate sharing the trainer's tensors. ``samples`` receives
        a few (prompt, response, reward) per kind ("greedy", "sampled") for the report."""
        backend.update_weights(rollout_weights(model, backend), backend.version)
        common = (backend, tokenizer, source.heldout_reward, heldout, cfg.rollout.max_tokens)
        record = samples if samples is not None else {}
        greedy, sampled = {}, {}
        result = {"accuracy": heldout_accuracy(*common, encode=encode, record=record.setdefault("greedy", []),
                                               details=greedy)}
        if cfg.trainer.eval_samples:
            result["sampled_accuracy"] = heldout_accuracy(*common, encode=encode, temperature=cfg.rollout.temperature,
                                                          samples=cfg.trainer.eval_samples, seed=cfg.seed,
                                                          record=record.setdefault("sampled", []), details=sampled)
        if "tool_call_rate" in greedy:  # workflows: how often the policy calls a tool
            result["tool_call_rate"] = greedy["tool_call_rate"]
            result["sampled_tool_call_rate"] = sampled.get("tool_call_rate")
        return result

    before_samples: dict = {}
    before = evaluate(before_samples)
    sft_accuracy = before["accuracy"]
    console.print(f"held-out accuracy before RL: [bold]{_fmt(before)}[/] ({len(heldout)} examples)")
    controller = build_controller(cfg, model, backend, tokenizer, source, encode)
    actor = controller.actor
    sinks = MetricSinks(run_dir, cfg.logging.tensorboard)
    if cfg.logging.wandb:
        from asyncrl.metrics.wandb_sink import WandbSink
        sinks.sinks.append(WandbSink(run_dir, cfg.logging.wandb_project, cfg.name, to_dict(cfg),
                                     cfg.logging.wandb_mode, cfg.logging.wandb_entity))
    _write_samples(sinks, 0, before_samples)
    health = HealthMonitor(cfg.health, events_path=run_dir / "health_events.jsonl", mode=cfg.runtime.mode)
    profile = StageProfile()
    steps_done, step_wall, rl_start = 0, 0.0, time.perf_counter()
    failed: list[float] = []  # reward/failed_fraction per step (a dataset's reward pool)
    try:
        with StepProgress(cfg.trainer.steps, cfg.logging.progress) as progress:
            for step in range(1, cfg.trainer.steps + 1):
                step_start = time.perf_counter()
                metrics = {**controller.step(step), **source.step_metrics()}  # + reward/<name>, failures
                step_wall += time.perf_counter() - step_start  # measured apart from the stage timer
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and heldout:
                    samples: dict = {}
                    result = evaluate(samples)
                    metrics.update({f"eval/{k}": v for k, v in result.items()})
                    _write_samples(sinks, step, samples)
                    progress.print(f"step {step}: held-out accuracy {_fmt(result)} (before RL: {_fmt(before)})")
                metrics.update(profile.observe_row(metrics))  # the same row metrics.jsonl gets
                if "reward/failed_fraction" in metrics:
                    failed.append(metrics["reward/failed_fraction"])
                if cfg.health.enabled:
                    health.warn(health.observe(step, metrics, controller.last_samples), console)
                    metrics.update(health.step_metrics())
                sinks.write(step, metrics)
                progress.advance(metrics)
                steps_done = step
                if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
                    _checkpoint(run_dir, step, actor, tokenizer, cfg, source)
                if cfg.trainer.max_wall_seconds and time.perf_counter() - rl_start > cfg.trainer.max_wall_seconds:
                    console.print(f"[yellow]stopping after {step} steps: trainer.max_wall_seconds reached[/]")
                    break
    finally:
        sinks.close()
        if cfg.runtime.mode == "async":
            controller.close()  # stop the rollout side before the final eval and checkpoint
    if cfg.health.enabled:
        health.finish(console)  # episodes still open, once, with their counts
    rl_seconds = time.perf_counter() - rl_start
    after_samples: dict = {}
    after = evaluate(after_samples)
    final_accuracy = after["accuracy"]
    checkpoint = _checkpoint(run_dir, steps_done, actor, tokenizer, cfg, source)
    getattr(backend, "close", lambda: None)()  # a workflow's engine thread
    gain = final_accuracy - sft_accuracy if heldout else None
    summary = {
        "name": cfg.name, "seed": cfg.seed, "run_dir": str(run_dir), "steps": steps_done,
        "sft_accuracy": sft_accuracy, "final_accuracy": final_accuracy,
        "sft_sampled_accuracy": before.get("sampled_accuracy"), "final_sampled_accuracy": after.get("sampled_accuracy"),
        **{f"{when}_{k}": r[k] for when, r in (("sft", before), ("final", after)) for k in
           ("tool_call_rate", "sampled_tool_call_rate") if r.get(k) is not None},
        "accuracy_gain": gain, "rl_seconds": rl_seconds, "source": source.name,
        "wall_seconds": time.perf_counter() - wall_start,
        "step_wall_seconds": step_wall, "stage_seconds": dict(profile.stage_seconds),
        "checkpoint": str(checkpoint),
        "reward_failed_fraction": sum(failed) / len(failed) if failed else None,
        "profile": profile.summary(), "memory": controller.memory.summary(), "health": health.summary(),
        **{k: v for k, v in model_info.items()},
    }
    write_atomic_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    _write_final_samples(run_dir, steps_done, after_samples, cfg.logging.tensorboard)
    console.print(summary_table(summary))
    if summary["reward_failed_fraction"]:
        console.print(f"[bold yellow]reward calls failed on {100 * summary['reward_failed_fraction']:.1f}% of the "
                      "samples (scored reward.default_score): see reward/failed_fraction and the pool's failures[/]")
    console.print(profile_table(summary["profile"]))
    console.print(headline(summary["profile"]))
    if cfg.logging.report:
        from asyncrl.metrics.report import write_report
        from asyncrl.metrics.report_plots import available
        if not available():
            console.print("[yellow]report written without plots: matplotlib is not installed "
                          "(pip install 'asyncrl[report]')[/]")
        console.print(f"report: {write_report(run_dir)}")
    if heldout:
        console.print(f"held-out accuracy before RL: {_fmt(before)}")
        console.print(f"held-out accuracy after RL:  {_fmt(after)}  ([bold]{_gains(before, after)}[/])")
    console.print(f"run directory: {run_dir}")
    return summary


def build_controller(cfg, model, backend, tokenizer, source, encode):
    """``runtime.mode``: sync shares ``backend`` (the trainer's model); async builds a rollout
    backend with its own copy of the weights and runs it concurrently (async_controller.py)."""
    if cfg.runtime.mode == "async":
        return build_async_controller(cfg, model, tokenizer, source.reward, source.train_stream(), encode=encode)
    return build_sync_controller(cfg, model, backend, tokenizer, source.reward, source.train_stream(), encode=encode)


def _write_samples(sinks: MetricSinks, step: int, samples: dict) -> None:
    """The eval's recorded completions, one tag per kind (``samples/greedy``, ``samples/sampled``)."""
    for kind, rows in samples.items():
        if rows:
            sinks.write_samples(step, f"samples/{kind}", rows)


def _write_final_samples(run_dir: Path, step: int, samples: dict, tensorboard: bool) -> None:
    """The final eval's completions (the step sinks are closed by then): samples.jsonl, TensorBoard."""
    sinks = MetricSinks(run_dir, tensorboard)
    try:
        _write_samples(sinks, step, samples)
    finally:
        sinks.close()


def _gains(before: dict, after: dict) -> str:
    return ", ".join(f"{name.replace('_accuracy', '').replace('accuracy', 'greedy')} "
                     f"{100 * (after[name] - before[name]):+.1f} points" for name in before if after.get(name) is not None)


def _fmt(result: dict) -> str:
    if result.get("accuracy") is None:
        return "n/a (no held-out set)"
    sampled = result.get("sampled_accuracy")
    return f"greedy {result['accuracy']:.3f}" + (f", sampled {sampled:.3f}" if sampled is not None else "")


def _checkpoint(run_dir: Path, step: int, actor: Actor, tokenizer, cfg, source) -> Path:
    """The policy, its optimizer, and where the prompt stream is (``data``: resumable)."""
    state = {"policy_version": actor.version, "seed": cfg.seed, "data": source.state_dict()}
    # a LoRA policy (PEFT) saves its adapter in PEFT's format; with actor.lora.save_merged also merged/
    extra = (lambda directory: save_merged(actor.model, directory / "merged", tokenizer)) \
        if cfg.actor.lora.enabled and cfg.actor.lora.save_merged else None
    return save_checkpoint(run_dir, step, actor.model, tokenizer, actor.optimizer, actor.scheduler,
                           state, keep=cfg.trainer.keep_checkpoints, extra=extra)
