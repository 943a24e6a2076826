"""asyncrl: fast, transparent, fully asynchronous RL post-training for language models.

    import asyncrl
    summary = asyncrl.train("quickstart", trainer={"steps": 200})        # or asyncrl.Trainer(...).train()

    from asyncrl import LLM, SamplingParams                              # the engine, vLLM's shape
    outputs = LLM(model_path).generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=64))
    outputs[0].outputs[0].text

Every name below is imported on first use (PEP 562), so ``import asyncrl`` stays light: torch,
transformers and the engine load only when a name that needs them is asked for.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "train": "asyncrl.api", "Trainer": "asyncrl.api",
    "Config": "asyncrl.config", "load_config": "asyncrl.config",
    "LLM": "asyncrl.engine.llm",
    "SamplingParams": "asyncrl.types", "RequestOutput": "asyncrl.types", "Completion": "asyncrl.types",
    "CompletionOutput": "asyncrl.types", "Example": "asyncrl.types", "TrainBatch": "asyncrl.types",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
