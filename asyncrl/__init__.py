"""asyncrl: fast, transparent, fully asynchronous RL post-training for language models."""
from asyncrl.types import Completion, Example, RequestOutput, SamplingParams, TrainBatch

__version__ = "0.1.0"
__all__ = ["Completion", "Example", "RequestOutput", "SamplingParams", "TrainBatch", "__version__"]
