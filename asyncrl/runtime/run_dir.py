"""The run directory: ``runs/<time>-<name>`` with the resolved config and all outputs."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from asyncrl.config import config_to_yaml
from asyncrl.metrics.console import console
from asyncrl.training.model import resolve_device


def make_run_dir(cfg) -> Path:
    if cfg.logging.run_dir:
        path = Path(cfg.logging.run_dir)
    else:
        path = Path(cfg.logging.output_dir) / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.name}"
        suffix = 1
        while path.exists():  # two runs started within the same second
            path = path.with_name(f"{path.name}-{suffix}")
            suffix += 1
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(config_to_yaml(cfg))
    return path


def start_run(cfg, header: str) -> tuple[torch.device, Path]:
    """What every job (train, sft, dpo) does first: torch threads and seed from the config,
    the device, the run directory; prints ``header -> run_dir``. Returns (device, run_dir)."""
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    run_dir = make_run_dir(cfg)
    console.print(f"{header} -> {run_dir}")
    return resolve_device(cfg.trainer.device), run_dir
