"""Held-out accuracy through the rollout backend: greedy, or mean@k of sampled responses."""
from __future__ import annotations

from typing import Callable, Optional

from asyncrl.data.sources import generate_for_examples, grade_completions
from asyncrl.types import Example, SamplingParams


def heldout_accuracy(backend, tokenizer, reward_fn: Callable[..., float], examples: list[Example],
                     max_tokens: int, batch_size: int = 256,
                     encode: Optional[Callable[[Example], list[int]]] = None, temperature: float = 0.0,
                     samples: int = 1, seed: int = 0, record: Optional[list] = None,
                     record_limit: int = 4, details: Optional[dict] = None) -> Optional[float]:
    """Fraction of responses to ``examples`` the task's verifier marks correct (None without
    examples; :func:`~asyncrl.data.sources.grade_responses`: a shaping reward never counts).

    ``temperature=0``: one greedy response per example. Otherwise ``samples`` responses
    per example at ``temperature`` (seeded), i.e. mean@k: the policy's pass@1 as sampled.
    ``encode`` maps an example to its prompt ids (a dataset's chat template); by default
    the prompt text is tokenized as is. A chunk's responses are scored in one batch.
    ``record``: a list that receives ``{"prompt", "response", "reward"}`` of the first
    ``record_limit`` responses (one per example), for the report and TensorBoard. A workflow
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
            scores, graded = grade_completions(reward_fn, ex, out.completions)
            correct += sum(graded)
            called += sum(c.info.get("tool_calls", 0) > 0 for c in out.completions)
            if record is not None and len(record) < record_limit:
                record.append({"prompt": ex.prompt, "response": out.completions[0].text, "reward": float(scores[0])})
    if details is not None and hasattr(backend, "generate_examples"):
        details["tool_call_rate"] = called / (len(examples) * n)
    return correct / (len(examples) * n)
