"""mean@k / pass@k / maj@k of known answers through a mocked backend, and ``asyncrl eval``
end to end on GSM8K test with a tiny model (its accuracy is ~0; the numbers must agree
with a direct computation from the samples it wrote)."""
import json
import math
import shutil
from pathlib import Path

import pytest

from asyncrl.data.sources import SHIPPED_DATA
from asyncrl.cli import main
from asyncrl.data.sources import PoolReward
from asyncrl.eval.benchmark import evaluate_examples, summarize
from asyncrl.eval.job import resolve_model_path
from asyncrl.eval.metrics import majority_correct, pass_at_k
from asyncrl.rewards import build_reward_pool
from asyncrl.types import Completion, Example, RequestOutput, SamplingParams

DATA = SHIPPED_DATA  # the sets that ship inside the package (asyncrl/data/sets)

# uid -> (reference answer, the 4 responses the mocked model gives)
SCRIPT = {
    "0": ("4", ["#### 4", "#### 4", "#### 5", "#### 6"]),                      # c=2, majority "4" right
    "1": ("10", ["#### 3", "#### 3", "#### 10", "#### 10"]),                   # c=2, tie 3/10: 0.5
    "2": ("1/2", ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", "#### 7", "#### 7"]),  # c=2 (equivalent forms), majority "7"
    "3": ("9", ["no idea", "#### 8", "#### 8", "#### 8"]),                       # c=0
}


class ScriptedBackend:
    """The rollout protocol, answering each prompt (its id is the uid) with SCRIPT's responses."""

    version = 0

    def __init__(self):
        self.calls = []

    def generate(self, prompt_token_ids, params: SamplingParams):
        self.calls.append((len(prompt_token_ids), params.n))
        outputs = []
        for ids in prompt_token_ids:
            texts = SCRIPT[str(ids[0])][1][:params.n]
            outputs.append(RequestOutput(ids, None, [Completion([1], t, None, "stop", [0]) for t in texts]))
        return outputs

    def update_weights(self, named_tensors, version):
        self.version = version


def test_known_answers_give_known_numbers():
    examples = [Example(prompt=f"q{uid}", answer=ans, fields={"answer": ans}, uid=uid)
                for uid, (ans, _) in SCRIPT.items()]
    backend = ScriptedBackend()
    with build_reward_pool(["math"], mode="inline") as pool:
        reward = PoolReward(pool, record=False)
        results = evaluate_examples(backend, lambda ex: [int(ex.uid)], examples, reward,
                                    SamplingParams(n=4, temperature=1.0), batch_size=3)
        assert reward.drain_metrics() == {}  # held-out scoring stays out of the step metrics
    assert backend.calls == [(3, 4), (1, 4)]  # batches of 3 prompts, 4 samples each
    assert [r.num_correct for r in results] == [2, 2, 2, 0]
    numbers = summarize(results, k=4)
    assert numbers["num_prompts"] == 4
    assert numbers["mean@4"] == pytest.approx(6 / 16)               # 6 correct of 16 samples
    assert numbers["pass@1"] == pytest.approx(6 / 16)               # pass@1 is the mean
    assert numbers["pass@2"] == pytest.approx(3 * (1 - 1 / 6) / 4)   # c=2 of 4: 1 - C(2,2)/C(4,2) = 5/6
    assert numbers["pass@4"] == pytest.approx(3 / 4)                # any correct sample
    assert numbers["maj@4"] == pytest.approx((1 + 0.5 + 0 + 0) / 4)
    assert set(summarize(results, k=4, metrics=["maj"])) == {"num_prompts", "maj@4"}


def test_a_run_directory_resolves_to_its_latest_checkpoint(tiny_chat_checkpoint, tmp_path):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000004"
    shutil.copytree(tiny_chat_checkpoint, step)
    (step / "trainer_state.json").write_text('{"step": 4}')  # what makes a checkpoint complete
    (run / "checkpoints" / "latest").write_text("step_000004")
    assert resolve_model_path(str(run)) == step
    assert resolve_model_path(str(run / "checkpoints")) == step
    assert resolve_model_path(str(tiny_chat_checkpoint)) == Path(tiny_chat_checkpoint)
    with pytest.raises(ValueError, match="neither an HF model directory"):
        resolve_model_path(str(tmp_path))


@pytest.mark.skipif(not DATA.exists(), reason="asyncrl/data/sets not present")
def test_asyncrl_eval_on_gsm8k_test_with_a_tiny_model(tiny_chat_checkpoint, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = main(["eval", "gsm8k_grpo_cpu", f"model.path={tiny_chat_checkpoint}", f"logging.run_dir={out}",
               "data.eval_limit=3", "eval.k=3", "eval.max_tokens=8"])
    assert rc == 0
    assert "pass@2" in capsys.readouterr().out  # the table
    report = json.loads((out / "eval.json").read_text())
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert report["data"] == "gsm8k" and report["k"] == 3 and len(rows) == 3
    assert [r["uid"] for r in rows] == ["test.jsonl:0", "test.jsonl:1", "test.jsonl:2"]  # GSM8K test rows
    assert all(len(r["responses"]) == 3 and len(r["correct"]) == 3 for r in rows)
    m = report["metrics"]
    counts = [sum(r["correct"]) for r in rows]
    direct_pass2 = sum(1 - math.comb(3 - c, 2) / math.comb(3, 2) for c in counts) / 3
    assert m["pass@2"] == pytest.approx(direct_pass2)
    assert m["pass@3"] == pytest.approx(sum(pass_at_k(3, c, 3) for c in counts) / 3)
    assert m["mean@3"] == pytest.approx(sum(counts) / 9) == pytest.approx(m["pass@1"])
    assert m["maj@3"] == pytest.approx(sum(majority_correct(r["answers"], r["correct"]) for r in rows) / 3)
    assert all(0.0 <= v <= 1.0 for k, v in m.items() if k != "num_prompts")


def test_asyncrl_eval_needs_a_model(capsys, tmp_path):
    assert main(["eval", "eval_math", "model.path=null"]) == 2
    assert "needs model.path" in capsys.readouterr().err
    # a path that is no model, run directory or Hub id: one line naming what was looked for
    assert main(["eval", "eval_math", f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "is neither an HF model directory" in err and err.count("\n") == 1


@pytest.mark.skipif(not DATA.exists(), reason="asyncrl/data/sets not present")
@pytest.mark.parametrize("preset,rows", [("aime24", 30), ("amc23", 40), ("minerva_math", 272), ("gsm8k", 1319)])
def test_eval_math_recipe_reads_each_benchmark(preset, rows):
    from asyncrl.config import load_config
    from asyncrl.data.sources import build_prompt_source

    cfg = load_config("eval_math", [f"data.preset={preset}", "model.path=/unused", "reward.mode=inline"])
    source = build_prompt_source(cfg, train=False)
    examples = source.heldout_examples()
    assert len(examples) == rows and all(ex.fields["answer"] for ex in examples)
    assert ("####" if preset == "gsm8k" else "\\boxed{}") in examples[0].prompt
    source.close()


@pytest.mark.parametrize("backend", ["hf", "engine"])
def test_asyncrl_eval_on_the_synthetic_task(tiny_checkpoint, tmp_path, backend):
    out = tmp_path / "eval"
    assert main(["eval", "quickstart", f"model.path={tiny_checkpoint}", f"logging.run_dir={out}",
                 "task.num_eval=4", "eval.k=2", "eval.temperature=1.0", f"rollout.backend={backend}"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["data"] == "arithmetic" and report["metrics"]["num_prompts"] == 4
