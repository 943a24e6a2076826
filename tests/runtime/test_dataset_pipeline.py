"""``asyncrl train gsm8k_grpo_cpu``: GSM8K prompts in a chat template, the math reward in a
process pool, a tiny checkpoint. Finite metrics, each reward component and the failure
rate logged, the dataset position in the checkpoint, the pool closed at the end."""
import json
import math
from pathlib import Path

import pytest

import asyncrl.runtime.pipeline as pipeline
from asyncrl.data.sources import SHIPPED_DATA
from asyncrl.config import load_config
from asyncrl.data.sources import build_prompt_source

DATA = SHIPPED_DATA  # the sets that ship inside the package (asyncrl/data/sets)


@pytest.mark.skipif(not DATA.exists(), reason="asyncrl/data/sets not present")
def test_gsm8k_cpu_recipe_trains_through_the_reward_pool(tiny_chat_checkpoint, tmp_path, monkeypatch):
    built = []

    def recording_build(cfg):
        built.append(build_prompt_source(cfg))
        return built[-1]

    monkeypatch.setattr(pipeline, "build_prompt_source", recording_build)
    run = tmp_path / "run"
    # a second component that always raises (regex without a pattern): counted, weighed 0, the run goes on
    cfg = load_config("gsm8k_grpo_cpu", [
        f"model.path={tiny_chat_checkpoint}", f"logging.run_dir={run}", "logging.progress=false",
        "trainer.steps=2", "data.eval_limit=2", "rollout.max_tokens=8",
        "reward.rewards=[math, {name: broken, fn: regex, weight: 0.0}]"])
    summary = pipeline.run_training(cfg)
    assert summary["steps"] == 2 and summary["source"] == "gsm8k"
    assert summary["sft_accuracy"] == 0.0 and summary["final_accuracy"] == 0.0  # a random tiny model
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "reward/total", "reward/math", "reward/broken", "reward/failed_fraction",
                "reward/pool_calls", "actor/entropy", "time/reward"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert all(r["reward/failed_fraction"] == 1.0 for r in rows)
    state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
    assert state["data"]["source"] == "dataset"
    assert state["data"]["train"]["position"] == 2 * 2  # steps x prompts_per_step
    pool = built[0].pool
    assert pool.mode == "process"
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit([])


def test_bad_data_is_a_clear_cli_error_before_anything_runs(tmp_path, capsys):
    from asyncrl.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": "4"\n')
    run = tmp_path / "run"
    assert main(["train", "gsm8k_grpo_cpu", f"model.path={tmp_path}", f"data.path={bad}",
                 f"logging.run_dir={run}"]) == 2
    assert "bad.jsonl:2: malformed JSON line" in capsys.readouterr().err
    assert not run.exists()  # failed before the run directory, the model and the pool
    assert main(["train", "gsm8k_grpo"]) == 2
    assert "set model.path" in capsys.readouterr().err
