"""asyncrl on the issue-8 setting, sync and async, timed by its own stage timer (bench/peer_trl.py).

The run goes through the same calls as ``asyncrl train``: the config from the quickstart recipe
plus overrides, ``prepare_policy`` (model.path: the SFT checkpoint and its tokenizer, loaded by
AutoModelForCausalLM / AutoTokenizer), ``build_backend`` and ``build_controller``, then
``controller.step`` per step. What ``asyncrl train`` adds per step (metric sinks, health
monitors, progress bar) is left out here, as TRL's logging to files is.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from asyncrl.config import load_config
from asyncrl.data.sources import build_prompt_source
from asyncrl.rollout.registry import build_backend
from asyncrl.runtime.pipeline import build_controller, prepare_policy
from asyncrl.training.model import resolve_device

from peer_trl_clock import Limits, RunRecord, StepClock

# The GRPO in asyncrl's keys; each line names TRL's equivalent.
SETTINGS = [
    "trainer.prompts_per_step=16", "rollout.n=8",           # per_device_train_batch_size=128, num_generations=8
    "rollout.max_tokens=6", "rollout.temperature=1.0",     # max_completion_length=6, temperature=1.0
    "rollout.top_p=1.0", "rollout.top_k=-1",               # top_p=1.0, top_k=0 (off)
    "actor.lr=1e-4", "actor.warmup_steps=0",               # learning_rate=1e-4, lr_scheduler_type=constant
    "actor.weight_decay=0.0", "actor.grad_clip=1.0",       # weight_decay=0.0, max_grad_norm=1.0
    "actor.ppo_epochs=1", "actor.mini_batches=1",          # num_iterations=1, one optimizer step per generation
    "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true",  # scale_rewards=group
    "algorithm.policy_loss=ppo_clip", "algorithm.loss_agg_mode=token-mean",    # loss_type=dapo
    "algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.2",           # epsilon=0.2 (epsilon_high=epsilon)
    "algorithm.kl_coef=0.0", "algorithm.entropy_coeff=0.0",                    # beta=0.0
    "trainer.eval_every=0", "trainer.max_wall_seconds=null", "trainer.device=cpu",
    "logging.progress=false", "logging.report=false", "logging.tensorboard=false",
]
# sync: exactly TRL's loss (no behaviour weights; the quickstart's decoupled PPO is ~1 here, but
# TRL's generate path has no such weight). async: the quickstart's async settings.
SYNC = ["runtime.mode=sync", "algorithm.decoupled=false", "algorithm.rollout_correction.level=none"]
ASYNC = ["runtime.mode=async", "runtime.max_staleness=1", "algorithm.decoupled=true",
         "algorithm.rollout_correction.level=token"]


def trainer_threads(mode: str, threads: int) -> int:
    """The trainer's torch threads out of the run's ``threads`` (the issue: 2, TRL's one process).
    Async: the rollout process runs one thread (asyncrl/runtime/executors/process.py) on a core of
    its own, so the trainer takes the rest; 2 trainer threads + the rollout process would put 3
    busy threads on 2 cores, and the trainer's OpenMP barriers then wait for the thread that
    shares a core (its update 66 ms vs 45 ms at 1 thread, bench/RESULTS.md)."""
    return max(1, threads - 1) if mode == "async" else threads


def _set_affinity(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` on ``cores`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


@contextmanager
def split_cores(rollout_pid):
    """Async with the rollout in its own process: that process on the last core of this process's
    CPU set, the trainer's process (its training thread and its helper threads: rollout loop,
    pipe receiver, reward pool) on the others, restored afterwards. Unpinned, the OS runs the
    trainer's helper threads on the rollout's core now and then, and the rollout process is the
    bound of the step since the trainer's prefix tree (packing.py): pinned ran ~4% more steps
    (seed 0, 20 s runs, two alternating repeats: 3,451 / 3,537 vs 3,348 / 3,347 completions/s).
    A no-op on one core, without ``sched_setaffinity`` or without a rollout process."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if rollout_pid is None or len(cores) < 2:
        yield
        return
    _set_affinity(rollout_pid, {cores[-1]})
    _set_affinity(os.getpid(), set(cores[:-1]))
    try:
        yield
    finally:
        _set_affinity(os.getpid(), set(cores))


def asyncrl_config(checkpoint: str, seed: int, mode: str, threads: int, run_dir: str, extra=()):
    overrides = [*SETTINGS, f"model.path={checkpoint}", f"seed={seed}",
                 f"trainer.torch_threads={trainer_threads(mode, threads)}",
                 f"logging.run_dir={run_dir}", *(ASYNC if mode == "async" else SYNC), *extra]
    return load_config("quickstart", overrides)


def run_asyncrl(checkpoint: str, seed: int, mode: str, limits: Limits, evaluate, run_dir: str,
                threads: int, extra=(), between=None) -> RunRecord:
    """asyncrl GRPO (``mode`` sync or async) from ``checkpoint`` until ``limits``."""
    cfg = asyncrl_config(checkpoint, seed, mode, threads, run_dir, extra)
    record = RunRecord(f"asyncrl-{mode}", seed)
    record.extra["trainer_threads"] = cfg.trainer.torch_threads
    start = time.perf_counter()
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    source = build_prompt_source(cfg)
    model, tokenizer, _ = prepare_policy(cfg, source.task, resolve_device(cfg.trainer.device), announce=False)
    backend = build_backend(cfg.rollout.backend, model, tokenizer)
    controller = build_controller(cfg, model, backend, tokenizer, source, source.prompt_encoder(tokenizer))
    record.startup_seconds = time.perf_counter() - start
    rollout_pid = getattr(controller.backend, "pid", None) if mode == "async" else None
    record.extra["cores_split"] = rollout_pid is not None
    with split_cores(rollout_pid):
        return run_controller(controller, model, record, limits, evaluate, mode, between)


def run_controller(controller, model, record: RunRecord, limits: Limits, evaluate, mode: str,
                   between=None) -> RunRecord:
    """``controller.step`` until ``limits``, each step's stage seconds from the controller's timer;
    ``between()`` (off the clock) runs before each step: the other framework's turn."""
    batch = controller.cfg.trainer.prompts_per_step * controller.cfg.rollout.n
    clock = StepClock(record, limits, evaluate)
    clock.eval_now(model, 0)
    clock.restart()
    step = 0
    try:
        while True:
            step += 1
            if between is not None:
                between()
                clock.restart()
            metrics = controller.step(step)
            stages = dict(controller.timer.step_seconds)
            tokens = int(round(metrics["response/length_mean"] * batch))
            if mode == "async":  # overlapped with the trainer: not part of the step's wall time
                stages["async_rollout_busy"] = metrics.get("async/rollout_seconds", 0.0)
            # the trainer's throughput (issue 20), and where an async weight sync spends its time, per step
            for key in ("actor/mfu", "actor/tflops", "weight_sync/wait_s", "weight_sync/load_s", "weight_sync/probe_s"):
                if key in metrics:
                    record.extra.setdefault(key, []).append(metrics[key])
            if clock.step_done(step, stages, batch, tokens, model):
                break
    finally:
        if mode == "async":
            controller.close()
    record.extra["backend"] = type(controller.backend).__name__
    return record
