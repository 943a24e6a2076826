"""``asyncrl dpo`` on a small synthetic preference set: the preference accuracy and margin of
the training pairs rise from exactly 0 (policy = reference), the loss falls below log 2, and
the saved model loads in transformers. (Held-out pairs are reported, not asserted: a 5-step
SFT model cannot add, so it learns the training pairs without generalising.)"""
import json
import random

from transformers import AutoModelForCausalLM

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.data.tasks import build_task
from asyncrl.runtime.dpo_job import corrupt_answer, load_preferences
from tests.runtime.test_pipeline import FAST


def _write_pairs(path, count=96):
    task = build_task(load_config("quickstart").task, seed=0)
    stream = task.train_stream(seed=5)
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            ex = next(stream)
            f.write(json.dumps({"question": ex.prompt, "chosen": ex.answer,
                                "rejected": corrupt_answer(ex.answer, rng)}) + "\n")


def test_dpo_raises_the_preference_margin(tmp_path):
    data = tmp_path / "prefs.jsonl"
    _write_pairs(data)
    assert len(load_preferences(str(data), prompt_field="question")) == 96
    run = tmp_path / "run"
    code = main(["dpo", "quickstart", *FAST, f"sft.cache_dir={tmp_path / 'cache'}", f"logging.run_dir={run}",
                 "logging.tensorboard=false", f"dpo.data_path={data}", "dpo.prompt_field=question",
                 "dpo.steps=25", "dpo.batch_size=16", "dpo.lr=0.003", "dpo.beta=0.5"])
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert before["dpo_eval/rewards/margin"] == 0.0 and before["dpo_eval/rewards/accuracy"] == 0.0
    assert set(after) == set(before)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 25 and rows[0]["dpo/rewards/accuracy"] == 0.0  # first step: policy = reference
    late = rows[-5:]
    assert sum(r["dpo/rewards/accuracy"] for r in late) / 5 >= 0.7, late  # training pairs: accuracy rises
    assert sum(r["dpo/rewards/margin"] for r in late) / 5 > 0.0
    assert sum(r["dpo/loss"] for r in late) / 5 < 0.6                      # from log 2 = 0.693
    model = AutoModelForCausalLM.from_pretrained(summary["model"])
    assert model.config.model_type == "qwen3"
