"""Workflows in the runtime: the calculator recipe for a few steps, sync and async."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.runtime.pipeline import run_training
from asyncrl.runtime.validate import validate_config


def _cfg(tmp_path: Path, *extra: str):
    return load_config("calculator_tool", ["sft.steps=1", f"sft.cache_dir={tmp_path / 'cache'}", "trainer.steps=2",
                                           "task.num_eval=2", "trainer.eval_samples=1", "trainer.prompts_per_step=2",
                                           "rollout.n=2", "logging.report=false", "logging.tensorboard=false",
                                           "logging.progress=false", f"logging.output_dir={tmp_path}", *extra])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_calculator_workflow_trains(tmp_path, mode):
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, f"runtime.mode={mode}")
    summary = run_training(cfg)
    assert "sft_tool_call_rate" in summary and "final_sampled_tool_call_rate" in summary
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["workflow/turns_mean"] >= 1 and row["rollout/logprob_gap"] < 1e-4
        if mode == "async":
            assert row["async/staleness_violations"] == 0


def test_workflow_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="rollout.backend"):
        validate_config(_cfg(tmp_path, "rollout.backend=hf"))
    with pytest.raises(ConfigError, match="rollout_process"):
        validate_config(_cfg(tmp_path, "runtime.mode=async", "runtime.rollout_process=true"))
    with pytest.raises(ConfigError, match="workflow.fn=calculator"):
        validate_config(load_config("calculator_tool", ["workflow.fn=null"]))
    with pytest.raises(ConfigError, match="base_url"):
        validate_config(load_config("quickstart", ["rollout.backend=openai"]))
