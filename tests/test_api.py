"""The Python API: ``asyncrl.train`` / ``Trainer`` over the config tree, rewards and datasets as
Python objects, ``from asyncrl import LLM, SamplingParams`` with vLLM's ``outputs``, and an
``import asyncrl`` that loads no torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import asyncrl
from asyncrl.api import Trainer, build_config
from asyncrl.config import ConfigError

TINY = {"model.tiny.hidden_size": 32, "model.tiny.num_hidden_layers": 2, "model.tiny.head_dim": 8,
        "model.tiny.intermediate_size": 64, "sft.steps": 5, "sft.batch_size": 16, "task.num_eval": 8,
        "trainer": {"steps": 2, "prompts_per_step": 4, "eval_samples": 0}, "rollout.n": 4,
        "logging.progress": False, "logging.tensorboard": False, "logging.report": False}


def test_import_asyncrl_is_light():
    code = "import sys, asyncrl; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_build_config_merges_sections_and_checks_keys():
    cfg = build_config("quickstart", {"trainer": {"steps": 7}, "rollout.n": 4, "data.extra_fields": {"a": "b"}})
    assert cfg.trainer.steps == 7 and cfg.trainer.prompts_per_step == 16  # the recipe's other keys kept
    assert cfg.rollout.n == 4 and cfg.data.extra_fields == {"a": "b"} and cfg.name == "quickstart"
    assert build_config(cfg, {"seed": 3}).seed == 3 and build_config({"trainer": {"steps": 1}}).trainer.steps == 1
    with pytest.raises(ConfigError, match="unknown config key 'trainer.step' \\(did you mean 'trainer.steps'\\?\\)"):
        build_config("quickstart", {"trainer": {"step": 5}})
    with pytest.raises(ConfigError, match="rollout.n"):
        build_config(None, {"rollout.n": 0})  # ranges checked as on the CLI


def _exact_answer(prompt, response, **fields):
    """A module-level reward: picklable, so it runs in the reward worker processes."""
    return 1.0 if response.strip() == fields["answer"] else 0.0


def test_train_with_a_python_reward_on_the_synthetic_task(tmp_path):
    summary = asyncrl.train("quickstart", reward_funcs=[_exact_answer, lambda p, r, **f: 0.0], **TINY,
                            logging={"run_dir": str(tmp_path / "run")}, sft={"cache_dir": str(tmp_path / "cache")})
    assert summary["steps"] == 2 and summary["run_dir"] == str(tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "reward/_exact_answer" in rows[0] and rows[0]["reward/<lambda>"] == 0.0  # each component logged


def test_trainer_with_python_rows_and_a_model_path(tmp_path, tiny_chat_checkpoint):
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(12)]
    trainer = Trainer("gsm8k_grpo_cpu", reward_funcs=["math"], train_dataset=rows[:8], eval_dataset=rows[8:],
                      model={"path": str(tiny_chat_checkpoint)}, reward={"mode": "inline"},
                      trainer={"steps": 2, "eval_samples": 0}, rollout={"max_tokens": 4},
                      logging={"run_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False,
                               "report": False})
    trainer.config.actor.lr = 1e-6  # the typed config, before train()
    summary = trainer.train()
    assert summary["steps"] == 2 and summary["source"] == "python" and trainer.run_dir == tmp_path / "run"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["sft_accuracy"] is not None  # 4 held out
    assert "lr: 1.0e-06" in (tmp_path / "run" / "config.yaml").read_text()


def test_llm_and_sampling_params_from_the_top_level(tiny_checkpoint):
    from asyncrl import LLM, SamplingParams

    [out] = LLM(str(tiny_checkpoint), device="cpu").generate("12+34=", SamplingParams(n=2, max_tokens=3, seed=0))
    assert len(out.outputs) == 2 and out.outputs is out.completions  # vLLM's name, the old one kept
    assert all(isinstance(c.text, str) and len(c.token_ids) <= 3 for c in out.outputs)
