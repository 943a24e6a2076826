"""The run directory: ``runs/<time>-<job>-<name>`` (job: train, sft, eval, dpo) with the
resolved config and all outputs."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from asyncrl.config import config_to_yaml
from asyncrl.metrics.console import console
from asyncrl.training.model import quiet_transformers, resolve_device


def make_run_dir(cfg, job: str = "train") -> Path:
    """``logging.run_dir``, else ``<output_dir>/<time>-<job>-<name>`` (the job named, so an
    eval of a recipe is not mistaken for its training run)."""
    if cfg.logging.run_dir:
        path = Path(cfg.logging.run_dir)
    else:
        path = Path(cfg.logging.output_dir) / f"{time.strftime('%Y%m%d-%H%M%S')}-{job}-{cfg.name}"
        suffix = 1
        while path.exists():  # two runs started within the same second
            path = path.with_name(f"{path.name}-{suffix}")
            suffix += 1
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(config_to_yaml(cfg))
    return path


def start_run(cfg, header: str, job: str = "train") -> tuple[torch.device, Path]:
    """What every job (train, sft, dpo) does first: torch threads and seed from the config,
    the device, the run directory; prints ``header -> run_dir``. Returns (device, run_dir)."""
    quiet_transformers()
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    run_dir = make_run_dir(cfg, job)
    console.print(f"{header} -> {run_dir}")
    return resolve_device(cfg.trainer.device), run_dir
