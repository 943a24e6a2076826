"""Hugging Face Hub ids, for every place that takes a model or a dataset path.

A Hub id is ``org/name`` where no such local path exists. Models are brought into the HF cache
by ``huggingface_hub.snapshot_download`` (once; offline afterwards with ``HF_HUB_OFFLINE=1``)
and then read as the local directory it returns, as vLLM does; datasets go through
``datasets.load_dataset`` (asyncrl/data/datasets.py). A leaf: it imports nothing from asyncrl.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Union

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: What a causal LM checkpoint needs from a Hub repo (not its .bin/.pth/.onnx/.gguf duplicates).
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv")


class HubError(ValueError):
    """A Hub id that could not be resolved (offline without a cache, unknown or gated repo)."""


def is_hub_id(path: Union[str, Path]) -> bool:
    """True for ``org/name`` that is neither a local path nor a data file's name."""
    text = str(path)
    return bool(_HUB_ID.match(text)) and not Path(text).exists() and not text.lower().endswith(_DATA_SUFFIXES)


def model_snapshot(repo_id: str) -> Path:
    """The local directory of ``repo_id``'s model files, downloaded into the HF cache if needed."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES))
    except Exception as err:  # offline without a cache, unknown or gated repo, network down
        first = str(err).splitlines()[0] if str(err) else ""
        raise HubError(f"{repo_id!r}: no such local directory, and the Hugging Face Hub could not provide it "
                       f"({type(err).__name__}: {first})") from None
