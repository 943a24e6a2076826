"""Held-out accuracy through the rollout backend: greedy, or mean@k of sampled responses."""
from __future__ import annotations

from typing import Callable, Optional

from asyncrl.data.sources import generate_for_examples, score_completions
from asyncrl.types import Example, SamplingParams


def heldout_accuracy(backend, tokenizer, reward_fn: Callable[..., float], examples: list[Example],
                     max_tokens: int, batch_size: int = 256,
                     encode: Optional[Callable[[Example], list[int]]] = None, temperature: float = 0.0,
                     samples: int = 1, seed: int = 0, details: Optional[dict] = None) -> Optional[float]:
    """Fraction of responses to ``examples`` that earn reward 1 (None without examples).

    ``temperature=0``: one greedy response per example. Otherwise ``samples`` responses
    per example at ``temperature`` (seeded), i.e. mean@k: the policy's pass@1 as sampled.
    ``encode`` maps an example to its prompt ids (a dataset's chat template); by default
    the prompt text is tokenized as is. A chunk's responses are scored in one batch. A workflow
    backend runs whole episodes (scored by the workflow); ``details``, when given, receives
    ``tool_call_rate`` (episodes with at least one tool call) for them.
    """
    if not examples:
        return None
    encode = encode or (lambda ex: tokenizer(ex.prompt)["input_ids"])
    n = 1 if temperature <= 0 else samples
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=False, seed=seed)
    correct = called = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        outputs = generate_for_examples(backend, encode, chunk, params)
        for ex, out in zip(chunk, outputs):
            correct += sum(float(s) >= 1.0 for s in score_completions(reward_fn, ex, out.completions))
            called += sum(c.info.get("tool_calls", 0) > 0 for c in out.completions)
    if details is not None and hasattr(backend, "generate_examples"):
        details["tool_call_rate"] = called / (len(examples) * n)
    return correct / (len(examples) * n)
