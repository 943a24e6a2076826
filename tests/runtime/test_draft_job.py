"""``asyncrl train-draft`` end to end on a tiny local checkpoint: the engine samples task prompts,
the head trains, the checkpoint and ``train_draft.json`` are written, and the head loads into the
engine by path."""
import json

from asyncrl.cli import main


def test_train_draft_writes_a_head_the_engine_loads(tiny_checkpoint, tmp_path):
    out = tmp_path / "head"
    rc = main(["train-draft", "quickstart", f"model.path={tiny_checkpoint}", f"draft.output={out}",
               "draft.prompts=8", "draft.steps=4", "draft.batch_size=8", "draft.eval_prompts=4", "rollout.n=2",
               "trainer.device=cpu", f"logging.output_dir={tmp_path / 'runs'}"])
    assert rc == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    record = json.loads((out / "train_draft.json").read_text())
    assert record["samples"] == 16 and record["train"]["steps"] == 4
    assert set(record["acceptance"]) == {"greedy", "sampled"}
    assert set(record["acceptance"]["greedy"]) == {"eagle", "eagle_before_training", "ngram"}
    head_info = json.loads((out / "config.json").read_text())["eagle_head"]
    assert head_info["feature"] == "final_norm_hidden" and head_info["steps"] == 4


def test_train_draft_refuses_a_head_of_another_model(tiny_checkpoint, tmp_path, capsys):
    bad = tmp_path / "not_a_head"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    rc = main(["train-draft", "quickstart", f"model.path={tiny_checkpoint}", f"draft.init={bad}",
               "draft.prompts=2", "draft.steps=1", "draft.eval_prompts=0", "rollout.n=1", "trainer.device=cpu"])
    assert rc == 2 and "is not an EAGLE head checkpoint" in capsys.readouterr().err  # refused before loading
