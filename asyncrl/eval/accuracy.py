"""Held-out accuracy through the rollout backend (greedy decoding)."""
from __future__ import annotations

from typing import Callable, Optional

from asyncrl.data.sources import score_responses
from asyncrl.types import Example, SamplingParams


def heldout_accuracy(backend, tokenizer, reward_fn: Callable[..., float], examples: list[Example],
                     max_tokens: int, batch_size: int = 256,
                     encode: Optional[Callable[[Example], list[int]]] = None) -> Optional[float]:
    """Fraction of ``examples`` whose greedy response earns reward 1 (None without examples).

    ``encode`` maps an example to its prompt ids (a dataset's chat template); by default
    the prompt text is tokenized as is. A chunk's responses are scored in one batch.
    """
    if not examples:
        return None
    encode = encode or (lambda ex: tokenizer(ex.prompt)["input_ids"])
    params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, logprobs=False)
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        completions = [out.completions[0] for out in backend.generate([encode(ex) for ex in chunk], params)]
        scores = score_responses(reward_fn, [ex.prompt for ex in chunk], [c.text for c in completions],
                                 [{**ex.fields, "finish_reason": c.finish_reason} for ex, c in zip(chunk, completions)])
        correct += sum(float(s) >= 1.0 for s in scores)
    return correct / len(examples)
