"""``asyncrl sft``: supervised fine-tuning as a job of its own (stage 1 before RL).

Fine-tunes ``model.path`` (or the tiny model built from ``model.tiny``) on the task's
demonstrations, or on ``sft.data_path`` (jsonl of prompt/response), and saves an HF
checkpoint in ``<run_dir>/model`` that ``asyncrl train model.path=...`` can start from.
Each step's ``sft/loss`` goes to ``metrics.jsonl`` and TensorBoard (``asyncrl report`` reads
them) and to a progress bar.
"""
from __future__ import annotations

import json

from asyncrl.data.char_tokenizer import build_char_tokenizer, save_and_reload
from asyncrl.data.demonstrations import cycle_shuffled, load_demonstrations
from asyncrl.data.tasks import build_task
from asyncrl.eval.accuracy import heldout_accuracy
from asyncrl.metrics.console import StepProgress, console
from asyncrl.metrics.sinks import MetricSinks
from asyncrl.rollout.hf import HFGenerateBackend
from asyncrl.runtime.run_dir import releasing_run_dirs, start_run
from asyncrl.training.checkpoint import write_atomic_text
from asyncrl.training.model import build_tiny_model, load_policy
from asyncrl.training.sft import run_sft


@releasing_run_dirs
def run_sft_job(cfg) -> dict:
    device, run_dir = start_run(cfg, "[bold]asyncrl sft[/]", job="sft")
    task = build_task(cfg.task, cfg.seed)
    if cfg.model.path:
        model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
    else:
        build = getattr(task, "build_tokenizer", None)  # a tool-use task: its tool tokens and chat template
        tokenizer = build(run_dir / "model") if build is not None else \
            save_and_reload(build_char_tokenizer(task.charset), run_dir / "model")
        model = build_tiny_model(cfg.model.tiny, tokenizer, cfg.seed).to(device)
    if cfg.sft.data_path:
        stream = cycle_shuffled(load_demonstrations(cfg.sft.data_path, cfg.sft.prompt_field,
                                                    cfg.sft.response_field), cfg.seed)
    else:
        stream = getattr(task, "demonstrations", task.train_stream)(seed=10_000 + cfg.seed)  # tool use: transcripts
    backend = HFGenerateBackend(model, tokenizer)
    accuracy = lambda: heldout_accuracy(backend, tokenizer, task.reward, task.eval_examples(), cfg.rollout.max_tokens)
    before = accuracy()
    console.print(f"held-out accuracy before SFT: {before:.3f} ({len(task.eval_examples())} examples)")
    sinks = MetricSinks(run_dir, cfg.logging.tensorboard)
    try:
        with StepProgress(cfg.sft.steps, cfg.logging.progress, label="SFT",
                          info=lambda m: f"loss {m['sft/loss']:.4f}") as progress:
            def on_step(step: int, loss: float) -> None:
                metrics = {"sft/loss": loss}
                sinks.write(step + 1, metrics)
                progress.advance(metrics)

            info = run_sft(model, tokenizer, stream, cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr,
                           cfg.sft.warmup_steps, cfg.actor.logprob_chunk_tokens, schedule=cfg.sft.lr_schedule,
                           min_lr_ratio=cfg.sft.min_lr_ratio, on_step=on_step)
    finally:
        sinks.close()
    after = accuracy()
    model.save_pretrained(str(run_dir / "model"), safe_serialization=True)
    tokenizer.save_pretrained(str(run_dir / "model"))
    summary = {**info, "accuracy_before": before, "accuracy_after": after, "model": str(run_dir / "model")}
    write_atomic_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    console.print(f"SFT loss {info['sft/final_loss']:.4f} after {cfg.sft.steps} steps; held-out accuracy "
                  f"{before:.3f} -> {after:.3f}; model saved to {run_dir / 'model'}")
    return summary
