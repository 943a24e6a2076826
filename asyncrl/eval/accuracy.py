"""Held-out accuracy through the rollout backend: greedy, or mean@k of sampled responses."""
from __future__ import annotations

from typing import Callable, Optional

from asyncrl.data.sources import grade_responses
from asyncrl.types import Example, SamplingParams


def heldout_accuracy(backend, tokenizer, reward_fn: Callable[..., float], examples: list[Example],
                     max_tokens: int, batch_size: int = 256,
                     encode: Optional[Callable[[Example], list[int]]] = None, temperature: float = 0.0,
                     samples: int = 1, seed: int = 0, record: Optional[list] = None,
                     record_limit: int = 4) -> Optional[float]:
    """Fraction of responses to ``examples`` the task's verifier marks correct (None without
    examples; :func:`~asyncrl.data.sources.grade_responses`: a shaping reward never counts).

    ``temperature=0``: one greedy response per example. Otherwise ``samples`` responses
    per example at ``temperature`` (seeded), i.e. mean@k: the policy's pass@1 as sampled.
    ``encode`` maps an example to its prompt ids (a dataset's chat template); by default
    the prompt text is tokenized as is. A chunk's responses are scored in one batch.
    ``record``: a list that receives ``{"prompt", "response", "reward"}`` of the first
    ``record_limit`` responses (one per example), for the report and TensorBoard.
    """
    if not examples:
        return None
    encode = encode or (lambda ex: tokenizer(ex.prompt)["input_ids"])
    n = 1 if temperature <= 0 else samples
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=False, seed=seed)
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        outputs = backend.generate([encode(ex) for ex in chunk], params)
        pairs = [(ex, c) for ex, out in zip(chunk, outputs) for c in out.completions]
        scores, graded = grade_responses(reward_fn, [ex.prompt for ex, _ in pairs], [c.text for _, c in pairs],
                                         [{**ex.fields, "finish_reason": c.finish_reason} for ex, c in pairs])
        correct += sum(graded)
        if record is not None:
            firsts = [(ex, c, s) for i, ((ex, c), s) in enumerate(zip(pairs, scores)) if i % n == 0]
            record.extend({"prompt": ex.prompt, "response": c.text, "reward": float(s)}
                          for ex, c, s in firsts[:max(record_limit - len(record), 0)])
    return correct / (len(examples) * n)
