"""SpeculativeConfig: vLLM's ``speculative_config`` dict, typed and checked.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4})
    LLM(model, speculative_config={"method": "draft_model", "model": "path/to/small", ...})
    LLM(model, speculative_config={"method": "eagle", "model": "path/to/head", ...})  # asyncrl train-draft

The same keys are ``rollout.speculative.*`` in the training config. ``adaptive`` (default True):
within ``disable_by_batch_size``, speculate only while speculative steps emit tokens at least as
fast (wall time) as plain decode steps at the batch size (spec/adaptive.py); False: always. ``eagle``: an EAGLE-style
draft head on the target's last hidden states (spec/eagle_head.py); vLLM's ``eagle3`` (features
fused from three layers) is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

METHODS = ("ngram", "draft_model", "eagle")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4     # k: drafts per sequence per step
    prompt_lookup_max: int = 4          # ngram: longest suffix matched
    prompt_lookup_min: int = 2          # ngram: shortest suffix matched
    group_lookup: bool = True           # ngram: also match the request's sibling samples (GRPO group)
    model: Any = None                   # draft_model: a model with the target's tokenizer; eagle: a head dir
    draft_sampling: str = "greedy"      # greedy: argmax drafts (one-hot rule); probabilistic: sampled, with q
    disable_by_batch_size: int = 32     # adaptive: speculate only while <= this many sequences run
    min_acceptance: float = 0.0         # a sequence stops drafting once its acceptance rate falls below this
    acceptance_window: int = 64         # ... measured over at least this many of its drafts
    adaptive: bool = True               # speculate only while measured faster than plain decode (spec/adaptive.py);
                                        # timing-driven: a seed's sampled tokens can differ run to run (False: reproducible)

    def __post_init__(self):
        if self.method == "eagle3":
            raise ValueError("speculative method 'eagle3' (features fused from three target layers) is not "
                             "implemented in asyncrl yet; use 'eagle' (a head on the last hidden state)")
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.method != "ngram" and self.model is None:
            raise ValueError(f"speculative method {self.method!r} needs 'model' (a checkpoint dir)")
        if self.draft_sampling not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sampling must be 'greedy' or 'probabilistic', got {self.draft_sampling!r}")
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1), got {self.min_acceptance}")

    @classmethod
    def from_any(cls, spec: Any) -> Optional["SpeculativeConfig"]:
        """None, a SpeculativeConfig, or a dict with these keys (unknown keys raise)."""
        if spec is None or isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        return cls(**spec)
