"""TRL's GRPOTrainer on the issue-8 setting, timed by stage (bench/peer_trl.py).

Stages per optimizer step (seconds), measured by wrapping GRPOTrainer methods and with
callbacks, so TRL's own code runs unchanged:

    generate      ``_generate``: prompt tokenisation, ``model.generate``, decoding
    score         the rest of ``_generate_and_score_completions``: rewards, advantages, padding
    loss_forward  ``compute_loss``: the policy forward and the GRPO loss
    backward      ``accelerator.backward``
    optimizer     ``clip_grad_norm`` is before it; ``optimizer.step`` between the pre/post callbacks
    other         the rest of the step wall time (grad clipping, scheduler, logging, dataloader)
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from peer_trl_clock import Baton, Limits, RunRecord, StepClock


class _Stages:
    """Seconds per named stage since the last ``take``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.tokens = 0
        self.completions = 0

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def take(self) -> tuple[dict[str, float], int, int]:
        out = (self.seconds, self.completions, self.tokens)
        self.seconds, self.completions, self.tokens = {}, 0, 0
        return out


def _now() -> float:
    """Wall time after the GPU's queued work (stage boundaries must not leak kernels)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with its generate / score / loss-forward / backward time recorded."""

    def __init__(self, *args, stages: _Stages, **kwargs):
        super().__init__(*args, **kwargs)
        self.stages = stages
        backward = self.accelerator.backward

        def timed_backward(loss, **kw):
            start = _now()
            backward(loss, **kw)
            self.stages.add("backward", _now() - start)
        self.accelerator.backward = timed_backward

    def _generate(self, prompts):
        start = _now()
        out = super()._generate(prompts)
        self.stages.add("generate", _now() - start)
        return out

    def _generate_and_score_completions(self, inputs):
        start = _now()
        generated_before = self.stages.seconds.get("generate", 0.0)
        out = super()._generate_and_score_completions(inputs)
        generate = self.stages.seconds.get("generate", 0.0) - generated_before
        self.stages.add("score", _now() - start - generate)
        self.stages.completions += int(out["completion_mask"].shape[0])
        self.stages.tokens += int(out["completion_mask"].sum())
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        start = _now()
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.stages.add("loss_forward", _now() - start)
        return loss


class _ClockCallback(TrainerCallback):
    """Stage and step times into the record; with a ``baton``, one step per turn (the clock
    restarts when the turn comes, so the other framework's step is never counted)."""

    def __init__(self, clock: StepClock, stages: _Stages, baton: Optional[Baton] = None):
        self.clock, self.stages, self.baton, self._opt_start = clock, stages, baton, 0.0

    def _wait_turn(self) -> None:
        if self.baton is not None:
            self.baton.wait_turn()
        self.clock.restart()

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.clock.eval_now(model, 0)
        self._wait_turn()

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self._opt_start = _now()

    def on_optimizer_step(self, args, state, control, **kw):
        self.stages.add("optimizer", _now() - self._opt_start)

    def on_step_end(self, args, state, control, model=None, **kw):
        seconds, completions, tokens = self.stages.take()
        wall = _now() - self.clock.last
        seconds["other"] = max(wall - sum(seconds.values()), 0.0)
        if self.clock.step_done(state.global_step, seconds, completions, tokens, model):
            control.should_training_stop = True  # the baton is handed back once train() returned
        elif self.baton is not None:
            self.baton.pass_back()
            self._wait_turn()


def reward_exact_with_eos(eos_id: int):
    """1.0 for exactly the answer, terminated by EOS (the same reward asyncrl's task gives)."""
    def exact_with_eos(prompts, completions, completion_ids, answer, **_):
        return [1.0 if ids and ids[-1] == eos_id and text.strip() == ans else 0.0
                for text, ids, ans in zip(completions, completion_ids, answer)]
    return exact_with_eos


def trl_config(out_dir: str, seed: int, threads: int, max_steps: int, **overrides) -> GRPOConfig:
    """The issue's GRPO settings in TRL's terms: 16 prompts x 8, 6 new tokens, T=1, lr 1e-4
    constant, beta 0, loss_type dapo (token-mean over the batch), epsilon 0.2, one update per
    generation, fp32 (bf16 off), no gradient checkpointing (TRL's default is on: off is faster)."""
    del threads  # torch threads are set by the caller
    base = dict(output_dir=out_dir, seed=seed, per_device_train_batch_size=128, num_generations=8,
                gradient_accumulation_steps=1, max_completion_length=6, temperature=1.0, top_p=1.0,
                learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                beta=0.0, loss_type="dapo", epsilon=0.2, num_iterations=1, scale_rewards="group",
                max_steps=max_steps, shuffle_dataset=False, bf16=False, fp16=False,
                gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no",
                logging_steps=10, disable_tqdm=True, dataloader_num_workers=0)
    base.update(overrides)
    return GRPOConfig(**base)


def prompt_dataset(task, seed: int, rows: int) -> Dataset:
    """The first ``rows`` prompts of the seed's training stream, in order (shuffle off), so
    TRL's step k sees the same 16 prompts as asyncrl's step k."""
    stream = task.train_stream(seed=seed)
    examples = [next(stream) for _ in range(rows)]
    return Dataset.from_dict({"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})


def run_grpo_trainer(model, tokenizer, config: GRPOConfig, dataset: Dataset, reward, limits: Limits,
                     evaluate: Optional[object], seed: int, start: float, baton: Optional[Baton] = None) -> RunRecord:
    """Train with ``TimedGRPOTrainer`` until ``limits``; ``model`` is a module or a checkpoint
    path (then ``config.model_init_kwargs`` load it). Startup counts from ``start``."""
    record = RunRecord("trl", seed)
    stages = _Stages()
    clock = StepClock(record, limits, evaluate)
    trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward, args=config,
                               train_dataset=dataset, callbacks=[_ClockCallback(clock, stages, baton)], stages=stages)
    record.startup_seconds = time.perf_counter() - start
    try:
        trainer.train()
    finally:  # after TRL's end-of-training work, so it never runs beside the other framework's step
        if baton is not None:
            baton.finish()
    if evaluate is not None and (not record.evals or record.evals[-1]["step"] != len(record.step_seconds)):
        clock.eval_now(trainer.model, len(record.step_seconds))
    record.extra["trl_version"] = __import__("trl").__version__
    return record


def run_trl(checkpoint: str, task, seed: int, limits: Limits, evaluate, out_dir: str, threads: int,
            max_steps_cap: int = 20_000, baton: Optional[Baton] = None) -> RunRecord:
    """GRPO in TRL from the CPU setting's ``checkpoint`` until ``limits``."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    steps = limits.steps or max_steps_cap
    return run_grpo_trainer(model, tokenizer, trl_config(out_dir, seed, threads, steps),
                            prompt_dataset(task, seed, steps * 16), reward_exact_with_eos(tokenizer.eos_token_id),
                            limits, evaluate, seed, start, baton)
