"""Building, saving and loading policy models through the real HF paths.

A tiny model is a ``Qwen3ForCausalLM`` built from a config with random weights; it is
saved with ``save_pretrained`` (safetensors) and loaded back with
``AutoModelForCausalLM.from_pretrained`` exactly like a real local checkpoint.

``model.path`` may be an HF checkpoint directory, a run directory or its ``checkpoints/``
(the latest checkpoint), or a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``), which
``huggingface_hub.snapshot_download`` brings into the HF cache once (offline afterwards,
``HF_HUB_OFFLINE=1``) as vLLM does, so everything downstream reads a local directory.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from asyncrl.config_schema import ConfigError
from asyncrl.errors import ModelLoadError
from asyncrl.hub import HubError, is_hub_id, model_snapshot
from asyncrl.training.checkpoint import latest_checkpoint
from asyncrl.training.hf_kernels import route_cpu_to_torch_kernels

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_model(tiny_cfg, tokenizer, seed: int):
    """A randomly initialised model sized by ``tiny_cfg`` (a ``TinyModelConfig``): Qwen3, or Qwen3.5
    (``architecture: qwen3_5``; its linear-attention layers get key heads = KV heads, value heads =
    attention heads, head dims = head_dim)."""
    if getattr(tiny_cfg, "architecture", "qwen3") == "qwen3_5":
        return _tiny_qwen3_5(tiny_cfg, tokenizer, seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=tiny_cfg.hidden_size,
        intermediate_size=tiny_cfg.intermediate_size, num_hidden_layers=tiny_cfg.num_hidden_layers,
        num_attention_heads=tiny_cfg.num_attention_heads, num_key_value_heads=tiny_cfg.num_key_value_heads,
        head_dim=tiny_cfg.head_dim, max_position_embeddings=tiny_cfg.max_position_embeddings,
        rope_theta=tiny_cfg.rope_theta, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def _tiny_qwen3_5(tiny_cfg, tokenizer, seed: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    route_cpu_to_torch_kernels()  # a CPU model must not reach FLA's Triton kernels (hf_kernels.py)

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=tiny_cfg.hidden_size, intermediate_size=tiny_cfg.intermediate_size,
        num_hidden_layers=tiny_cfg.num_hidden_layers, num_attention_heads=tiny_cfg.num_attention_heads,
        num_key_value_heads=tiny_cfg.num_key_value_heads, head_dim=tiny_cfg.head_dim,
        linear_num_key_heads=tiny_cfg.num_key_value_heads, linear_num_value_heads=tiny_cfg.num_attention_heads,
        linear_key_head_dim=tiny_cfg.head_dim, linear_value_head_dim=tiny_cfg.head_dim,
        max_position_embeddings=tiny_cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": tiny_cfg.rope_theta, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(config)


def quiet_transformers() -> None:
    """Silence transformers' per-file "Loading weights" / "Writing model shards" bars (noise
    around our own progress bar), keeping the hub's download bars, which show real waiting."""
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # also turns the hub's off...
    enable_progress_bars()             # ...which a download should keep


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str | Path) -> None:
    """Refuse a ``model.path`` that cannot load, naming the file and the cause (transformers
    would say "install sentencepiece or tiktoken" for a directory without a tokenizer, or
    raise a bare SafetensorError for a truncated file)."""
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model path '{path}' is not a directory with config.json and weights")
    if not (root / "config.json").is_file():
        raise ModelLoadError(f"model path {root} has no config.json: not an HF model directory")
    safetensors = sorted(root.glob("*.safetensors"))
    if not safetensors and not list(root.glob("pytorch_model*.bin")):
        raise ModelLoadError(f"model path {root} has no weights (*.safetensors or pytorch_model*.bin)")
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"model path {root} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    for file in safetensors:
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                if names:  # the last tensor's bytes lie at the end: a truncated file fails here
                    f.get_slice(names[-1])
        except Exception as err:
            raise ModelLoadError(f"{file} is not a readable safetensors file (truncated or corrupt: {err})") from None


def resolve_model_path(path: str | Path) -> Path:
    """A local HF model directory for ``model.path``: the directory itself (config.json), the
    latest checkpoint of a run directory (or of its checkpoints/), or the cached snapshot of a
    Hub id. Anything else is a one-line :class:`ConfigError` naming what was looked for."""
    given = Path(path).expanduser()
    if (given / "config.json").is_file():
        return given
    for run_dir in (given, given.parent):  # a run dir, or its checkpoints/ dir
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is not None:
            return checkpoint
    if not is_hub_id(str(path)):
        raise ConfigError(f"model.path={str(path)!r} is neither an HF model directory (config.json) nor a run "
                          "directory with checkpoints/latest, nor a Hugging Face Hub id (org/name)")
    try:
        return model_snapshot(str(path))
    except HubError as err:
        raise ConfigError(f"model.path={err}") from None


def load_policy(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) from ``path`` as :func:`resolve_model_path` reads it."""
    quiet_transformers()
    path = str(resolve_model_path(path))
    check_model_dir(path)  # missing weights or tokenizer, a truncated file: named, not a loader's traceback
    tokenizer = AutoTokenizer.from_pretrained(path)
    route_cpu_to_torch_kernels()  # Qwen3.5 on a CPU: transformers' torch functions, even with fla-core installed
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype]).to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
