"""asyncrl: fast, transparent, fully asynchronous RL post-training for language models.

The records of ``asyncrl.types`` (which need torch) are imported on first use, so that
light subpackages (``asyncrl.rewards``, ``asyncrl.config``) load without torch.
"""
import importlib

__version__ = "0.1.0"
__all__ = ["Completion", "Example", "RequestOutput", "SamplingParams", "TrainBatch", "__version__"]
_TYPES = {"Completion", "Example", "RequestOutput", "SamplingParams", "TrainBatch"}


def __getattr__(name: str):
    if name in _TYPES:
        return getattr(importlib.import_module("asyncrl.types"), name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
