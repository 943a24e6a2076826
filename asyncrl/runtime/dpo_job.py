"""``asyncrl dpo``: offline preference optimisation (DPO) against a frozen reference.

Trains ``model.path`` (or the tiny model warm-started by SFT on the task, like ``train``)
on ``dpo.data_path``, a jsonl of ``{"prompt", "chosen", "rejected"}`` rows (field names
configurable), holding out a tenth of the pairs to report preference accuracy and margin
before and after; saves an HF checkpoint in ``<run_dir>/model``. Without ``data_path``,
pairs are built from the synthetic task: chosen = the reference answer, rejected = the
answer with its last digit changed, and held-out task accuracy is reported too.
"""
from __future__ import annotations

import json
import random
import time

from asyncrl.data.demonstrations import cycle_shuffled
from asyncrl.data.tasks import build_task
from asyncrl.eval.accuracy import heldout_accuracy
from asyncrl.metrics.console import console
from asyncrl.metrics.sinks import MetricSinks
from asyncrl.rollout.hf import HFGenerateBackend
from asyncrl.runtime.pipeline import prepare_policy
from asyncrl.runtime.run_dir import releasing_run_dirs, start_run
from asyncrl.training.checkpoint import write_atomic_text
from asyncrl.training.dpo import DPOTrainer, PreferencePair
from asyncrl.data.jsonl import read_string_records
from asyncrl.types import Example

MIN_EVAL_PAIRS = 8


def load_preferences(path: str, prompt_field: str = "prompt", chosen_field: str = "chosen",
                     rejected_field: str = "rejected") -> list[PreferencePair]:
    """Every row of a jsonl file as a pair; a bad row is refused naming its line and field."""
    fields = (prompt_field, chosen_field, rejected_field)
    pairs = [PreferencePair(row[prompt_field], row[chosen_field], row[rejected_field])
             for _, row in read_string_records(path, fields, "dpo.data_path")]
    if len(pairs) < 2:
        raise ValueError(f"{path}: need at least 2 preference pairs (one to train, one to evaluate)")
    return pairs


def corrupt_answer(answer: str, rng: random.Random) -> str:
    """A wrong answer close to ``answer``: its last digit shifted by 1..9 (else its last character dropped)."""
    if answer and answer[-1].isdigit():
        return answer[:-1] + str((int(answer[-1]) + rng.randint(1, 9)) % 10)
    return answer[:-1] or "?"


def task_preferences(examples: list[Example], seed: int) -> list[PreferencePair]:
    rng = random.Random(seed)
    return [PreferencePair(ex.prompt, ex.answer, corrupt_answer(ex.answer, rng)) for ex in examples]


def split_pairs(pairs: list[PreferencePair], seed: int) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out): a seeded shuffle, a tenth held out (at least MIN_EVAL_PAIRS when possible)."""
    order = list(pairs)
    random.Random(seed).shuffle(order)
    held = min(max(MIN_EVAL_PAIRS, len(order) // 10), len(order) // 2)
    return order[held:], order[:held]


@releasing_run_dirs
def run_dpo_job(cfg) -> dict:
    """Run ``asyncrl dpo``; returns the summary also written to ``summary.json``."""
    device, run_dir = start_run(cfg, "[bold]asyncrl dpo[/]", job="dpo")
    task = build_task(cfg.task, cfg.seed)
    model, tokenizer, model_info = prepare_policy(cfg, task, device)
    if cfg.dpo.data_path:
        pairs = load_preferences(cfg.dpo.data_path, cfg.dpo.prompt_field, cfg.dpo.chosen_field, cfg.dpo.rejected_field)
    else:
        stream = task.train_stream(seed=20_000 + cfg.seed)
        pairs = task_preferences([next(stream) for _ in range(cfg.dpo.num_pairs)], cfg.seed)
    train_pairs, eval_pairs = split_pairs(pairs, cfg.seed)
    trainer = DPOTrainer(model, cfg.dpo, max(1, cfg.actor.micro_batch_size // 2), cfg.actor.logprob_chunk_tokens)
    backend = HFGenerateBackend(model, tokenizer)
    task_accuracy = lambda: (heldout_accuracy(backend, tokenizer, task.reward, task.eval_examples(),
                                              cfg.rollout.max_tokens) if not cfg.dpo.data_path else None)
    before, accuracy_before = trainer.evaluate(eval_pairs, tokenizer), task_accuracy()
    console.print(f"{len(train_pairs)} training pairs, {len(eval_pairs)} held out; preference accuracy "
                  f"{before['dpo_eval/rewards/accuracy']:.3f}")
    stream, start = cycle_shuffled(train_pairs, cfg.seed), time.perf_counter()
    sinks = MetricSinks(run_dir, cfg.logging.tensorboard)
    try:
        for step in range(1, cfg.dpo.steps + 1):
            sinks.write(step, trainer.step([next(stream) for _ in range(cfg.dpo.batch_size)], tokenizer))
    finally:
        sinks.close()
    after, accuracy_after = trainer.evaluate(eval_pairs, tokenizer), task_accuracy()
    model.save_pretrained(str(run_dir / "model"), safe_serialization=True)
    tokenizer.save_pretrained(str(run_dir / "model"))
    summary = {"steps": cfg.dpo.steps, "seconds": time.perf_counter() - start, "pairs": len(pairs),
               "before": before, "after": after, "task_accuracy_before": accuracy_before,
               "task_accuracy_after": accuracy_after, "model": str(run_dir / "model"), **model_info}
    write_atomic_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    console.print(f"held-out preference accuracy {before['dpo_eval/rewards/accuracy']:.3f} -> "
                  f"{after['dpo_eval/rewards/accuracy']:.3f}, margin {before['dpo_eval/rewards/margin']:+.3f} -> "
                  f"{after['dpo_eval/rewards/margin']:+.3f}; model saved to {run_dir / 'model'}")
    if accuracy_before is not None:
        console.print(f"held-out task accuracy {accuracy_before:.3f} -> {accuracy_after:.3f}")
    return summary
