"""Held-out accuracy through the rollout backend (greedy decoding)."""
from __future__ import annotations

from typing import Callable

from asyncrl.types import Example, SamplingParams


def heldout_accuracy(backend, tokenizer, reward_fn: Callable[..., float], examples: list[Example],
                     max_tokens: int, batch_size: int = 256) -> float:
    """Fraction of ``examples`` whose greedy response earns reward 1."""
    params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, logprobs=False)
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        prompts = [tokenizer(ex.prompt)["input_ids"] for ex in chunk]
        for ex, out in zip(chunk, backend.generate(prompts, params)):
            c = out.completions[0]
            score = reward_fn(ex.prompt, c.text, **{**ex.fields, "finish_reason": c.finish_reason})
            correct += float(score or 0.0) >= 1.0
    return correct / max(1, len(examples))
