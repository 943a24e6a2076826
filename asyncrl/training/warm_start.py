"""The SFT warm start of a tiny model, cached so a second run skips it.

The cache key hashes everything that determines the result (model shape, task, SFT
settings, seed, tokenizer charset); the cached directory is a normal HF checkpoint
(config.json, model.safetensors, tokenizer files), written atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from asyncrl.config_schema import to_dict
from asyncrl.data.char_tokenizer import build_char_tokenizer, save_and_reload
from asyncrl.training.model import build_tiny_model
from asyncrl.training.sft import run_sft

_CACHE_FORMAT = 2  # bump when the warm-start recipe changes (2: linear lr decay)


def cache_root(cfg_dir: Optional[str]) -> Path:
    return Path(cfg_dir or os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl")


def warm_start_key(cfg, charset: str) -> str:
    sft = {k: v for k, v in to_dict(cfg.sft).items() if k not in ("cache", "cache_dir")}
    blob = json.dumps({"format": _CACHE_FORMAT, "tiny": to_dict(cfg.model.tiny), "task": to_dict(cfg.task),
                       "sft": sft, "seed": cfg.seed, "charset": charset,
                       "torch": torch.__version__.split("+")[0]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_checkpoint(cfg, task, device, on_step: Optional[Callable[[int, float], None]] = None) -> tuple[Path, dict]:
    """Path of a tiny-model checkpoint warm-started by SFT on ``task`` (from cache if present)."""
    path = cache_root(cfg.sft.cache_dir) / "warm_start" / warm_start_key(cfg, task.charset)
    if cfg.sft.cache and (path / "config.json").is_file():
        return path, {"sft/cached": 1.0}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    try:
        # a task with a chat format of its own (tool use) builds its tokenizer (special tokens, template)
        build = getattr(task, "build_tokenizer", None)
        tokenizer = build(tmp) if build is not None else save_and_reload(build_char_tokenizer(task.charset), tmp)
        model = build_tiny_model(cfg.model.tiny, tokenizer, cfg.seed).to(device)
        info = {"sft/cached": 0.0}
        if cfg.sft.enabled and cfg.sft.steps > 0:
            torch.manual_seed(cfg.seed)
            demos = getattr(task, "demonstrations", task.train_stream)  # tool use: whole transcripts
            info.update(run_sft(model, tokenizer, demos(seed=10_000 + cfg.seed), cfg.sft.steps,
                                cfg.sft.batch_size, cfg.sft.lr, cfg.sft.warmup_steps, schedule=cfg.sft.lr_schedule,
                                min_lr_ratio=cfg.sft.min_lr_ratio, on_step=on_step))
        model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "asyncrl_warm_start.json").write_text(json.dumps(info, indent=2))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path, info
