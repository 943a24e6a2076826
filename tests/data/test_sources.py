"""PromptSource: the synthetic task by default, a dataset (validated before any model
loads) with its reward pool, held-out resolution, chat-template encoding, metrics, state."""
import json
import string
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.data.char_tokenizer import build_char_tokenizer
from asyncrl.data.datasets import PRESETS, DatasetError
from asyncrl.data.sources import (PRESET_FILES, SHIPPED_DATA, DatasetSource, PoolReward, TaskSource, build_prompt_source,
                                  field_mapping, grade_completions, heldout_file_and_mapping,
                                  score_completions)
from asyncrl.types import Completion, Example

DATA = SHIPPED_DATA  # the sets that ship inside the package (asyncrl/data/sets)
needs_data = pytest.mark.skipif(not DATA.exists(), reason="asyncrl/data/sets not present")
INLINE = ["reward.mode=inline", "model.path=/unused"]  # a dataset needs model.path; nothing loads it here


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_default_is_the_synthetic_task():
    source = build_prompt_source(load_config("quickstart", ["task.num_eval=5"]))
    assert isinstance(source, TaskSource) and source.task.name == "arithmetic"
    assert len(source.heldout_examples()) == 5
    ex = next(source.train_stream())
    assert source.reward(ex.prompt, ex.answer, **ex.fields) == 1.0  # the task's exact checker
    tokenizer = build_char_tokenizer()
    assert source.prompt_encoder(tokenizer)(ex) == tokenizer(ex.prompt)["input_ids"]
    assert source.step_metrics() == {} and source.state_dict()["source"] == "task"


def test_config_choices_match_the_dataset_presets():
    cfg = load_config(None)
    meta = {f.name: f.metadata for f in cfg.data.__dataclass_fields__.values()}
    assert set(meta["preset"]["choices"]) == set(PRESETS) == set(meta["eval_preset"]["choices"])
    assert set(PRESET_FILES) <= set(PRESETS)


def test_dataset_needs_a_model_and_rewards_need_a_dataset():
    with pytest.raises(ConfigError, match="set model.path"):
        build_prompt_source(load_config("quickstart", ["data.preset=gsm8k"]))
    with pytest.raises(ConfigError, match="reward.rewards applies to datasets"):
        build_prompt_source(load_config("quickstart", ["reward.rewards=[math]"]))
    with pytest.raises(ConfigError, match="math_eval.*set data.path"):
        build_prompt_source(load_config("quickstart", ["data.preset=math_eval", *INLINE]))


def test_bad_rows_and_bad_rewards_fail_before_training(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl line 2: missing field 'answer'"):
        build_prompt_source(load_config("quickstart", [f"data.path={bad}", *INLINE]))
    good = _write_jsonl(tmp_path / "good.jsonl", [{"prompt": "1+1", "answer": "2"}])
    with pytest.raises(ConfigError, match="Did you mean 'math'"):
        build_prompt_source(load_config("quickstart", [f"data.path={good}", "reward.rewards=[mth]", *INLINE]))


def test_field_mapping_from_config_over_a_preset():
    cfg = load_config(None, ["data.preset=gsm8k"])
    assert field_mapping(cfg.data, "gsm8k") == PRESETS["gsm8k"]
    cfg = load_config(None, ["data.prompt_field=q", "data.answer_field=a", "data.uid_field=id",
                             "data.extra_fields={level: difficulty}"])
    mapping = field_mapping(cfg.data, "gsm8k")
    assert (mapping.prompt, mapping.answer, mapping.uid, mapping.extra) == ("q", "a", "id", {"level": "difficulty"})
    assert mapping.prompt_template is None  # the preset's template names its own prompt field


def test_heldout_resolution(tmp_path):
    def resolve(*overrides):
        path, _, _ = heldout_file_and_mapping(load_config(None, list(overrides)).data)
        return path and (path.parent.name, path.name)

    assert resolve("data.preset=gsm8k") == ("gsm8k", "test.jsonl")       # the preset's held-out split
    assert resolve("data.preset=gsm8k", "data.eval_preset=amc23") == ("math_eval", "amc23.jsonl")
    assert resolve("data.path=x.jsonl", f"data.eval_path={tmp_path / 'h.jsonl'}") == (tmp_path.name, "h.jsonl")
    assert resolve("data.path=x.jsonl") is None                          # a plain file has none


def test_dataset_source_streams_scores_through_the_pool_and_resumes(tmp_path):
    rows = [{"id": f"r{i}", "q": f"What is {i} + {i}?", "a": str(2 * i), "lvl": i % 3} for i in range(6)]
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    held = _write_jsonl(tmp_path / "held.jsonl", rows[:2])
    cfg = load_config("quickstart", [f"data.path={train}", f"data.eval_path={held}", "data.prompt_field=q",
                                     "data.answer_field=a", "data.uid_field=id", "data.extra_fields={lvl: level}",
                                     "reward.rewards=[math, {name: broken, fn: regex, weight: 0.0}]", *INLINE])
    source = build_prompt_source(cfg)
    assert isinstance(source, DatasetSource) and source.name == "train"
    assert [ex.uid for ex in source.heldout_examples()] == ["r0", "r1"]
    stream = source.train_stream()
    first = [next(stream) for _ in range(4)]
    assert first[0].fields == {"level": first[0].fields["level"], "answer": first[0].answer}
    state = json.loads(json.dumps(source.state_dict()))
    expected = [next(stream).uid for _ in range(5)]
    ex = first[0]
    done = [Completion([1], f"#### {ex.answer}", None, "stop"), Completion([1], "#### -1", None, "length")]
    assert score_completions(source.reward, ex, done) == [1.0, 0.0]  # math 1/0; broken weighs 0
    metrics = source.step_metrics()
    assert metrics["reward/math"] == 0.5 and metrics["reward/broken"] == 0.0
    assert metrics["reward/failed_fraction"] == 1.0  # regex without a pattern raises: recorded, run goes on
    assert metrics["reward/pool_failures"] == 2.0
    assert source.step_metrics() == {}  # drained
    assert source.heldout_reward(ex.prompt, "#### -1", **ex.fields) == 0.0 and source.step_metrics() == {}
    source.close()
    resumed = build_prompt_source(cfg)
    resumed.load_state_dict(state)
    assert [next(resumed.train_stream()).uid for _ in range(5)] == expected
    resumed.close()


def test_chat_template_encoding(tmp_path, tiny_chat_checkpoint):
    from transformers import AutoTokenizer

    train = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "answer": "1"}])
    cfg = load_config("quickstart", [f"data.path={train}", "data.system_prompt=be brief", *INLINE])
    source = build_prompt_source(cfg)
    tokenizer = build_char_tokenizer(string.printable)
    with pytest.raises(ConfigError, match="use_chat_template=false"):
        source.prompt_encoder(tokenizer)
    tokenizer.chat_template = AutoTokenizer.from_pretrained(tiny_chat_checkpoint).chat_template
    encoder = source.prompt_encoder(tokenizer)
    ex = Example(prompt="hi", answer="1")
    assert encoder.text(ex) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert tokenizer.decode(encoder(ex)) == encoder.text(ex)  # no <bos> from the template path
    plain = build_prompt_source(load_config("quickstart", [f"data.path={train}", "data.use_chat_template=false",
                                                           *INLINE]))
    assert plain.prompt_encoder(tokenizer)(ex) == tokenizer("hi")["input_ids"]
    source.close()
    plain.close()


@needs_data
def test_gsm8k_preset_loads_train_and_test():
    cfg = load_config("quickstart", ["data.preset=gsm8k", "data.limit=20", "data.eval_limit=3", *INLINE])
    source = build_prompt_source(cfg)
    assert len(source.train) == 20 and len(source.heldout_examples()) == 3
    assert source.heldout_examples()[0].uid == "test.jsonl:0"
    eval_only = build_prompt_source(load_config("quickstart", ["data.preset=aime24", *INLINE]), train=False)
    assert eval_only.train is None and len(eval_only.heldout_examples()) == 30
    source.close()
    eval_only.close()


def test_pool_reward_counts_a_failure_as_the_default_score():
    from asyncrl.rewards import build_reward_pool

    with build_reward_pool([{"fn": "regex", "name": "r"}], mode="inline", default_score=-1.0) as pool:
        reward = PoolReward(pool)
        assert reward.score_batch(["p"], ["x"], [{}]) == [-1.0]
        assert reward.drain_metrics()["reward/failed_fraction"] == 1.0


def test_batch_encoding_equals_one_by_one(tmp_path, tiny_chat_checkpoint):
    """``PromptEncoder.batch`` (one tokenizer call) gives each prompt's ids as ``__call__`` does,
    plain and through a chat template; ``encode_batch`` falls back to a plain callable."""
    from transformers import AutoTokenizer

    from asyncrl.data.sources import PromptEncoder, encode_batch

    tokenizer = build_char_tokenizer(string.printable)
    examples = [Example(prompt=p, answer="") for p in ("1+2=", "123+45=", "x", "  7 ")]
    plain = PromptEncoder(tokenizer)
    assert plain.batch(examples) == [plain(e) for e in examples] and plain.batch([]) == []
    tokenizer.chat_template = AutoTokenizer.from_pretrained(tiny_chat_checkpoint).chat_template
    train = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "answer": "1"}])
    chat = build_prompt_source(load_config("quickstart", [f"data.path={train}", *INLINE]))
    encoder = chat.prompt_encoder(tokenizer)
    assert encode_batch(encoder, examples) == [encoder(e) for e in examples]
    assert encode_batch(lambda e: [len(e.prompt)], examples) == [[4], [7], [1], [4]]
    chat.close()


def test_presets_read_the_sets_that_ship_with_the_package(monkeypatch):
    """No data directory beside the checkout: the presets' files are inside asyncrl/data/sets."""
    monkeypatch.delenv("ASYNCRL_DATA_DIR", raising=False)
    path, _, _ = heldout_file_and_mapping(load_config(None, ["data.preset=gsm8k"]).data)
    assert path == SHIPPED_DATA / "gsm8k" / "test.jsonl" and path.is_file()
    assert (SHIPPED_DATA / "gsm8k" / "LICENSE").is_file() and (SHIPPED_DATA / "math_eval" / "LICENSE").is_file()


def test_a_dataset_dicts_test_split_is_the_heldout_set(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "dd"))
    source = build_prompt_source(load_config("quickstart", [f"data.path={tmp_path / 'dd'}", *INLINE]))
    assert [ex.prompt for ex in source.heldout_examples()] == ["4+1", "5+1"]  # the test split, not nothing
    assert len(source.train) == 4
    source.close()
    with pytest.raises(DatasetError, match="without a 'dev' split \\(splits: train, test\\)"):
        build_prompt_source(load_config("quickstart", [f"data.path={tmp_path / 'dd'}", "data.split=dev", *INLINE]))


def test_a_missing_reward_dependency_is_a_named_error_at_start(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    good = _write_jsonl(tmp_path / "good.jsonl", [{"prompt": "1+1", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"^reward 'math' needs math-verify: pip install 'asyncrl\[tasks\]'$"):
        build_prompt_source(load_config("quickstart", [f"data.path={good}", *INLINE]))


def test_a_shaping_reward_never_counts_as_accuracy(tmp_path):
    """math (the verifier, listed first) + format with weight 1: a wrong answer in the right format
    scores 1.0 in total, and is still wrong."""
    train = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1", "answer": "2"}])
    cfg = load_config("quickstart", [f"data.path={train}", "reward.rewards=[math, {fn: regex, weight: 1.0, "
                                     "kwargs: {pattern: '####'}}]", *INLINE])
    source = build_prompt_source(cfg)
    ex = next(source.train_stream())
    done = [Completion([1], "#### 2", None, "stop"), Completion([1], "#### 3", None, "stop"),
            Completion([1], "2", None, "stop")]
    scores, correct = grade_completions(source.reward, ex, done)
    assert scores == [2.0, 1.0, 1.0] and correct == [1.0, 0.0, 1.0]  # "#### 3" scores 1.0 but is wrong
    source.close()


def test_a_plain_reward_returning_inf_or_nan_scores_zero():
    from asyncrl.data.sources import score_responses

    scores = score_responses(lambda p, r, **f: {"a": float("inf"), "b": float("nan"), "c": 1.0}[r],
                             ["p"] * 3, ["a", "b", "c"], [{}] * 3)
    assert scores == [0.0, 0.0, 1.0]
