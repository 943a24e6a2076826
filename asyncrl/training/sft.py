"""Supervised fine-tuning on demonstrations: stage 1 of the pipeline, before RL.

The loss is the mean negative log-likelihood of the response tokens (answer + EOS);
prompt tokens carry no loss, and neither do the parts of a multi-turn transcript the model
does not write (a tool's output: ``fields[SEGMENTS]``), as in TRL's ``assistant_only_loss``
and verl's multi-turn SFT loss mask. Log-probs come from the same chunked function the RL
trainer uses, so SFT and RL see the model identically.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import torch

from asyncrl.data.demonstrations import SEGMENTS
from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.logprobs import response_logprobs
from asyncrl.types import Example


def demonstration_batch(examples: list[Example], tokenizer):
    """Tokenised (prompt, answer + EOS) pairs, padded for ``response_logprobs``: input_ids and
    attention_mask [B, P+L], loss mask [B, L] (1 on the answer's trained tokens and the EOS), P."""
    prompts = [tokenizer(ex.prompt)["input_ids"] for ex in examples]
    answers, masks = zip(*(_answer_ids(ex, tokenizer) for ex in examples))
    input_ids, attention_mask, response_mask, prompt_len = pad_prompt_response(prompts, list(answers),
                                                                              tokenizer.pad_token_id)
    for row, mask in enumerate(masks):
        response_mask[row, :len(mask)] = torch.tensor(mask, dtype=response_mask.dtype)
    return input_ids, attention_mask, response_mask, prompt_len


def _answer_ids(example: Example, tokenizer) -> tuple[list[int], list[float]]:
    """(answer ids + EOS, loss mask): segments are tokenized one by one (a segment boundary is a
    token boundary, as in the episode the model will produce, where a tool's output is inserted)."""
    segments = example.fields.get(SEGMENTS) or [(example.answer, True)]
    if "".join(text for text, _ in segments) != example.answer:
        raise ValueError(f"{SEGMENTS} of {example.uid or example.prompt!r} do not join to its answer")
    ids, mask = [], []
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [float(bool(trained))] * len(piece)
    return ids + [tokenizer.eos_token_id], mask + [1.0]


def _lr_scale(schedule: str, steps: int, warmup_steps: int, min_lr_ratio: float = 0.0):
    """Multiplier of the peak lr at each step: linear warmup, then constant, or linear
    decay from 1 to ``min_lr_ratio`` at the last step (0: HF Trainer's default)."""
    def scale(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "linear":
            progress = (step - warmup_steps) / max(1, steps - warmup_steps)
            return 1.0 - (1.0 - min_lr_ratio) * min(1.0, progress)
        return 1.0
    return scale


def run_sft(model, tokenizer, stream: Iterator[Example], steps: int, batch_size: int, lr: float,
            warmup_steps: int = 0, chunk_tokens: int = 4096, schedule: str = "linear",
            min_lr_ratio: float = 0.0,
            on_step: Optional[Callable[[int, float], None]] = None) -> dict:
    """Train ``model`` in place for ``steps`` AdamW steps; returns loss and time stats."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    lr_scale = _lr_scale(schedule, steps, warmup_steps, min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_scale)
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(steps):
        examples = [next(stream) for _ in range(batch_size)]
        input_ids, attention_mask, response_mask, prompt_len = demonstration_batch(examples, tokenizer)
        logprobs, _ = response_logprobs(model, input_ids.to(device), attention_mask.to(device), prompt_len,
                                        chunk_tokens=chunk_tokens)
        mask = response_mask.to(device)
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach().item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return {"sft/steps": steps, "sft/final_loss": losses[-1] if losses else float("nan"),
            "sft/seconds": time.perf_counter() - start}
