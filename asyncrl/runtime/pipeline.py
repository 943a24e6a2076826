"""The whole training job: model (+ SFT warm start), held-out eval, RL steps, eval, checkpoint.

This composes the pieces; each piece lives in its own module.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

from asyncrl.data.sources import build_prompt_source
from asyncrl.distributed.group import SINGLE, DataParallel, init_distributed, shutdown
from asyncrl.distributed import lockstep
from asyncrl.eval.accuracy import heldout_accuracy
from asyncrl.metrics.console import StepProgress, console, summary_table
from asyncrl.metrics.fleet import FleetProfile
from asyncrl.config_schema import to_dict
from asyncrl.metrics.health import HealthMonitor
from asyncrl.metrics.profile import StageProfile, headline, profile_table
from asyncrl.metrics.sinks import MetricSinks
from asyncrl.config_schema import ConfigError
from asyncrl.rollout.registry import build_backend, engine_options, resolve_backend_name
from asyncrl.errors import NonFiniteError, Preempted
from asyncrl.runtime.weight_sync import clone_for_rollout
from asyncrl.runtime.async_controller import build_async_controller
from asyncrl.runtime.failures import write_traceback
from asyncrl.runtime.follower import follow_training
from asyncrl.runtime.guards import SkippedSteps
from asyncrl.runtime.preemption import Preemption
from asyncrl.runtime.rank_log import open_rank_log
from asyncrl.runtime.rank_memory import RankMemory, rank_memory_metrics
from asyncrl.runtime.resume import (CountingStream, ResumePoint, RunCheckpoints, attributes, config_for_resume,
                                    find_resume_checkpoint, refuse_to_overwrite, restore_attributes, truncate_logs)
from asyncrl.runtime.run_dir import discard_if_unused, release_run_dir, start_run
from asyncrl.runtime.sharded_checkpoint import ShardedCheckpointer, ShardedPolicyState
from asyncrl.runtime.roles import DTYPES
from asyncrl.runtime.sync_controller import build_sync_controller
from asyncrl.runtime.weight_sync import rollout_weights
from asyncrl.training.checkpoint import HFPolicyState, latest_checkpoint, write_atomic_text
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
    before any model loads; its pool is closed at the end. ``trainer.resume`` continues a run
    from a checkpoint (resume.py); SIGTERM/SIGINT stop it after the step in flight with a
    checkpoint (preemption.py). With several ranks (trainer.strategy=fsdp2), rank 0 runs the
    job and the other ranks serve its sharded calls (runtime/follower.py); they return an
    empty summary.
    """
    dp = start_ranks(cfg)
    try:
        if not dp.is_main:
            return follow_training(cfg, dp)
        try:
            source = source if source is not None else build_prompt_source(cfg)
            with Preemption() as preemption:  # covers the reward pool's shutdown too
                try:
                    return _train(cfg, source, preemption, dp)
                finally:
                    source.close()
        finally:
            lockstep.finish(dp)  # releases the followers, also when rank 0 failed
    finally:
        shutdown(dp)


def start_ranks(cfg) -> DataParallel:
    """This process's place in the trainer (distributed/group.py); the multi-rank job runs in
    lockstep (rank 0 drives). Sharding runs the sync runtime only."""
    dp = init_distributed(cfg.trainer)
    if dp.sharded and cfg.runtime.mode != "sync":
        shutdown(dp)
        raise ConfigError(f"trainer.strategy=fsdp2 (world size {dp.world_size}) runs runtime.mode=sync; "
                          f"runtime.mode={cfg.runtime.mode} with a sharded trainer is not implemented yet")
    return dataclasses.replace(dp, lockstep=True) if dp.world_size > 1 else dp


def rollout_backend(cfg, model, tokenizer, dp: DataParallel):
    """The rollout backend of ``model`` (rank 0 only). Sharded: the trainer's tensors become
    shards, so the backend gets its own full copy on rank 0's device (the engine always copies)."""
    if not dp.sharded:
        return build_backend(cfg.rollout.backend, model, tokenizer, **engine_options(cfg.rollout, cfg.actor.lora))
    if resolve_backend_name(cfg.rollout.backend, model) == "engine":
        return build_backend("engine", model, tokenizer, device=str(dp.device),
                             **engine_options(cfg.rollout, cfg.actor.lora))
    from asyncrl.rollout.hf import HFGenerateBackend

    return HFGenerateBackend(clone_for_rollout(model).to(dp.device), tokenizer)


def _train(cfg, source, preemption: Preemption, dp: DataParallel = SINGLE) -> dict:
    """Resolve the run directory (a resume continues its checkpoint's), lock it, and run;
    a failure leaves its traceback in error.log, or no directory at all before step 1."""
    wall_start = time.perf_counter()
    checkpoint = find_resume_checkpoint(cfg)
    cfg = config_for_resume(cfg, checkpoint)
    resume = ResumePoint(checkpoint) if checkpoint is not None else None
    if resume is None and cfg.logging.run_dir and cfg.trainer.resume == "never":
        refuse_to_overwrite(Path(cfg.logging.run_dir))
    device, run_dir = start_run(cfg, f"[bold]asyncrl[/] run [cyan]{cfg.name}[/]", job="train")
    if resume is None and cfg.trainer.resume != "never":
        truncate_logs(run_dir, 0)  # a stopped attempt that never checkpointed: start over cleanly
    try:
        if resume is not None and dp.sharded and cfg.critic.enable:
            raise ConfigError("trainer.resume with trainer.strategy=fsdp2 and critic.enable=true is not implemented: "
                              "the sharded checkpoint holds the actor only (resume without the critic, or in one "
                              "process)")
        if dp.world_size > 1:
            lockstep.announce(dp, "session", "open_run", str(run_dir))
            open_rank_log(run_dir, dp.rank)
        return _run(cfg, source, device, run_dir, resume, preemption, wall_start, dp)
    except BaseException as err:
        discarded = discard_if_unused(run_dir)  # failed before anything worth keeping
        if not isinstance(err, Preempted):
            write_traceback(err, None if discarded else run_dir)
        raise
    finally:
        release_run_dir(run_dir)


def _run(cfg, source, device, run_dir: Path, resume, preemption, wall_start: float,
         dp: DataParallel = SINGLE) -> dict:
    # sharded: the full policy stays in host memory until its shards are cut (it may not fit one GPU)
    model, tokenizer, model_info = prepare_policy(cfg, source.task, "cpu" if dp.sharded else device)
    if cfg.actor.lora.enabled:  # adapters on the loaded policy: only they train, and only they sync
        model = apply_lora(model, cfg.actor.lora)
    backend = wrap_backend(cfg, rollout_backend(cfg, model, tokenizer, dp),
                           tokenizer)  # a workflow runs whole episodes on it (asyncrl.workflows)
    encode, heldout = source.prompt_encoder(tokenizer), source.heldout_examples()
    prompts = CountingStream(source.train_stream(), resume.prompts if resume is not None else 0)
    lockstep.announce(dp, "session", "build", model_info["model_path"])  # the followers shard with rank 0 below
    controller = build_controller(cfg, model, backend, tokenizer, source, encode, prompts, run_dir, dp)
    rank_memory = RankMemory(dp, controller.memory)
    def evaluate(samples: Optional[dict] = None) -> dict:
        """Held-out accuracy: greedy, and mean@k sampled at the rollout temperature, of the
        trainer's current weights. The sync controller pushes them into ``backend`` after each
        update; the async one generates with a backend of its own, so ``backend`` (an engine
        holds its own copy) is refreshed here first — else async runs would evaluate the warm
        start. A no-op copy for HF generate sharing the trainer's tensors. (Sharded runs are
        sync: the backend already holds the current weights.) ``samples`` receives a few
        (prompt, response, reward) per kind ("greedy", "sampled") for the report."""
        if not dp.sharded:
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
    try:
        before = resume.run["before"] if resume is not None else evaluate(before_samples)  # the run's pre-RL eval
    except BaseException:
        getattr(controller, "close", lambda: None)()  # no rollout process left behind
        raise
    sft_accuracy = before["accuracy"]
    console.print(f"held-out accuracy before RL: [bold]{_fmt(before)}[/] ({len(heldout)} examples)")
    actor = controller.actor
    if actor.dp.sharded:  # every rank writes and loads its shards (sharded_checkpoint.py)
        lora = cfg.actor.lora
        policy_state = ShardedPolicyState(ShardedCheckpointer(actor, tokenizer, DTYPES[cfg.model.dtype],
                                                              lora.enabled and lora.save_merged))
    else:
        # a LoRA policy (PEFT) saves its adapter in PEFT's format; with actor.lora.save_merged also merged/
        extra = (lambda directory: save_merged(actor.model, directory / "merged", tokenizer)) \
            if cfg.actor.lora.enabled and cfg.actor.lora.save_merged else None
        policy_state = HFPolicyState(actor.model, tokenizer, actor.optimizer, actor.scheduler, extra=extra)
    checkpoints = RunCheckpoints(cfg, run_dir, controller, policy_state, source)
    health = HealthMonitor(cfg.health, events_path=run_dir / "health_events.jsonl", mode=cfg.runtime.mode)
    profile = StageProfile()
    fleet = FleetProfile()  # rollout replicas, if any (rollout.engines / tensor_parallel_size)
    totals = {"steps": 0, "step_wall": 0.0, "rl_seconds": 0.0, "wall_seconds": 0.0, "failed": []}
    if resume is not None:
        try:
            checkpoints.restore(resume)
        except BaseException:
            getattr(controller, "close", lambda: None)()  # no rollout process left behind
            raise
        restore_attributes(health, resume.run["health"])
        restore_attributes(profile, resume.run["profile"])
        if "fleet" in resume.run:  # checkpoints of runs before the fleet have none
            restore_attributes(fleet, resume.run["fleet"])
        totals = {**totals, **resume.run["totals"]}
        console.print(f"resumed from {resume.checkpoint} (step {resume.step}, {resume.prompts} prompts consumed)")
    purge = totals["steps"] + 1 if cfg.trainer.resume != "never" else None  # earlier events of these steps hidden
    sinks = MetricSinks(run_dir, cfg.logging.tensorboard, purge_step=purge)
    if cfg.logging.wandb:
        from asyncrl.metrics.wandb_sink import WandbSink
        sinks.sinks.append(WandbSink(run_dir, cfg.logging.wandb_project, cfg.name, to_dict(cfg),
                                     cfg.logging.wandb_mode, cfg.logging.wandb_entity))
    _write_samples(sinks, 0, before_samples)
    skipped = SkippedSteps(cfg.trainer.max_skipped_steps)
    steps_done, saved_step, step_wall, rl_start = totals["steps"], None, totals["step_wall"], time.perf_counter()
    failed: list[float] = list(totals["failed"])  # reward/failed_fraction per step (a dataset's reward pool)
    done_version = actor.version  # the policy version at the end of the last completed step

    def run_state() -> dict:
        """The pipeline's part of a checkpoint (resume.py): restored as it was."""
        return {"before": before, "health": attributes(health, skip=("cfg", "events_path")),
                "profile": attributes(profile), "fleet": attributes(fleet), "totals": {
                    "steps": steps_done, "step_wall": step_wall, "failed": list(failed),
                    "rl_seconds": totals["rl_seconds"] + time.perf_counter() - rl_start,
                    "wall_seconds": totals["wall_seconds"] + time.perf_counter() - wall_start}}

    last_eval = None  # (step, policy version, result) of the latest periodic eval
    preemption.defer()  # from here a signal finishes the step in flight, then checkpoints
    try:
        with StepProgress(cfg.trainer.steps, cfg.logging.progress, completed=steps_done) as progress:
            for step in range(steps_done + 1, cfg.trainer.steps + 1):
                if preemption.requested:
                    break
                step_start = time.perf_counter()
                metrics = {**_run_step(controller, step, checkpoints), **source.step_metrics()}
                if dp.world_size > 1:
                    metrics.update(rank_memory_metrics(rank_memory.gather_step()))
                step_wall += time.perf_counter() - step_start  # measured apart from the stage timer
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and heldout:
                    samples: dict = {}
                    result = evaluate(samples)
                    last_eval = (step, actor.version, result)
                    metrics.update({f"eval/{k}": v for k, v in result.items()})
                    _write_samples(sinks, step, samples)
                    progress.print(f"step {step}: held-out accuracy {_fmt(result)} (before RL: {_fmt(before)})")
                metrics.update(profile.observe_row(metrics))  # the same row metrics.jsonl gets
                if "reward/failed_fraction" in metrics:
                    failed.append(metrics["reward/failed_fraction"])
                fleet.observe(metrics)
                if cfg.health.enabled:
                    health.warn(health.observe(step, metrics, controller.last_samples), console)
                    metrics.update(health.step_metrics())
                sinks.write(step, metrics)
                progress.advance(metrics)
                steps_done, done_version = step, actor.version
                skipped.observe(step, metrics)
                if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
                    checkpoints.save(step, run_state())
                    saved_step = step
                if cfg.trainer.max_wall_seconds and time.perf_counter() - rl_start > cfg.trainer.max_wall_seconds:
                    console.print(f"[yellow]stopping after {step} steps: trainer.max_wall_seconds reached[/]")
                    break
    except Exception as err:
        if steps_done and saved_step != steps_done and actor.version == done_version:
            _checkpoint_after_failure(err, checkpoints, steps_done, run_state)
        raise
    finally:
        sinks.close()
        if cfg.runtime.mode == "async":  # stop the rollout side before the final eval and checkpoint
            controller.close(abandon=preemption.requested is not None)
    if cfg.health.enabled:
        health.finish(console)  # episodes still open, once, with their counts
    rl_seconds = totals["rl_seconds"] + time.perf_counter() - rl_start
    after_samples: dict = {}
    if preemption.requested:
        after = {}  # seconds left, not minutes
    elif last_eval is not None and last_eval[:2] == (steps_done, actor.version):
        after = last_eval[2]  # the last step's periodic eval measured these weights (its samples are written)
    else:
        after = evaluate(after_samples)
    final_accuracy = after.get("accuracy")
    checkpoint = checkpoints.save(steps_done, run_state()) if steps_done else None
    getattr(backend, "close", lambda: None)()  # a workflow's engine thread
    gain = final_accuracy - sft_accuracy if heldout and final_accuracy is not None else None
    summary = {
        "name": cfg.name, "seed": cfg.seed, "run_dir": str(run_dir), "steps": steps_done,
        "sft_accuracy": sft_accuracy, "final_accuracy": final_accuracy,
        "sft_sampled_accuracy": before.get("sampled_accuracy"), "final_sampled_accuracy": after.get("sampled_accuracy"),
        **{f"{when}_{k}": r[k] for when, r in (("sft", before), ("final", after)) for k in
           ("tool_call_rate", "sampled_tool_call_rate") if r.get(k) is not None},
        "accuracy_gain": gain, "rl_seconds": rl_seconds, "source": source.name,
        "wall_seconds": totals["wall_seconds"] + time.perf_counter() - wall_start,
        "step_wall_seconds": step_wall, "stage_seconds": dict(profile.stage_seconds),
        "checkpoint": str(checkpoint) if checkpoint else None,
        "resumed_from_step": resume.step if resume is not None else None, "preempted": preemption.requested,
        "reward_failed_fraction": sum(failed) / len(failed) if failed else None,
        "profile": profile.summary(), **({"fleet": fleet.summary()} if fleet.active else {}),
        "memory": controller.memory.summary(), "health": health.summary(),
        **({"memory_per_rank": rank_memory.gather_run()} if dp.world_size > 1 else {}),
        **({"world_size": dp.world_size} if dp.sharded else {}),
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
    if fleet.active:
        console.print(fleet.line())
    if cfg.logging.report:
        from asyncrl.metrics.report import write_report
        from asyncrl.metrics.report_plots import available
        if not available():
            console.print("[yellow]report written without plots: matplotlib is not installed "
                          "(pip install 'asyncrl[report]')[/]")
        console.print(f"report: {write_report(run_dir)}")
    if heldout and after:
        console.print(f"held-out accuracy before RL: {_fmt(before)}")
        console.print(f"held-out accuracy after RL:  {_fmt(after)}  ([bold]{_gains(before, after)}[/])")
    console.print(f"run directory: {run_dir}")
    if preemption.requested:
        console.print(f"stopped by {preemption.requested} after step {steps_done}/{cfg.trainer.steps}; to resume, run "
                      f"the same command with trainer.resume=auto logging.run_dir={run_dir}")
    return summary


def _run_step(controller, step: int, checkpoints) -> dict:
    """One controller step; non-finite weights are reported with the step and the last good
    checkpoint (nothing poisoned was saved)."""
    try:
        return controller.step(step)
    except NonFiniteError as err:
        latest = latest_checkpoint(checkpoints.run_dir)
        good = f"the last good checkpoint is {latest}" if latest else "no checkpoint was written"
        raise NonFiniteError(f"step {step}: {err}; {good} (lower actor.lr, then trainer.resume=auto)") from err


def _checkpoint_after_failure(err: Exception, checkpoints, steps_done: int, run_state) -> None:
    """A run that fails between steps (the rollout process died past runtime.max_restarts, a
    hang, too many skipped steps) keeps its last completed step. The caller checked that the
    weights are still those of ``steps_done`` (no update of the failed step went in);
    poisoned weights are never saved."""
    if isinstance(err, NonFiniteError):
        return
    try:
        path = checkpoints.save(steps_done, run_state())
    except Exception as save_err:  # the original failure stays the one reported
        console.print(f"[red]no checkpoint after the failure: {save_err}[/]")
        return
    console.print(f"checkpoint of step {steps_done} written after the failure: {path} (trainer.resume=auto)")


def build_controller(cfg, model, backend, tokenizer, source, encode, prompts=None, run_dir=None,
                     dp: DataParallel = SINGLE):
    """``runtime.mode``: sync shares ``backend`` (the trainer's model); async builds a rollout
    backend with its own copy of the weights and runs it concurrently (async_controller.py);
    a rollout fleet's replica logs go to ``run_dir/rollout``.
    ``prompts``: the training stream (default: the source's, from its start)."""
    prompts = prompts if prompts is not None else source.train_stream()
    if cfg.runtime.mode == "async":
        log_dir = run_dir / "rollout" if run_dir is not None else None
        return build_async_controller(cfg, model, tokenizer, source.reward, prompts, encode=encode, log_dir=log_dir)
    return build_sync_controller(cfg, model, backend, tokenizer, source.reward, prompts, encode=encode, dp=dp)


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
