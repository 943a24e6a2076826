"""Datasets: formats, field mapping, validation errors, seeded order, resume."""
import json
from pathlib import Path

import pytest

from asyncrl.data.sources import SHIPPED_DATA
from asyncrl.data.datasets import (
    GSM8K, MINERVA, DatasetError, preset_mapping, ExampleDataset, FieldMapping, load_dataset, load_examples,
)

DATA = SHIPPED_DATA  # the sets that ship inside the package (asyncrl/data/sets)

ROWS = [
    {"question": "1+1?", "solution": "#### 2", "level": 1, "meta": {"src": "a"}, "id": "q0"},
    {"question": "2+2?", "solution": "#### 4", "level": 2, "meta": {"src": "b"}, "id": "q1"},
    {"question": "3+3?", "solution": "#### 6", "level": 3, "meta": {"src": "c"}, "id": "q2"},
]
MAPPING = FieldMapping(prompt="question", answer="solution", extra={"level": "difficulty", "meta.src": "src"},
                       uid="id")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_with_field_mapping(tmp_path):
    examples = load_examples(write_jsonl(tmp_path / "d.jsonl", ROWS), MAPPING)
    first = examples[0]
    assert (first.prompt, first.answer, first.uid) == ("1+1?", "#### 2", "q0")
    assert first.fields == {"difficulty": 1, "src": "a", "answer": "#### 2"}


def test_parquet_json_csv_and_hf_give_the_same_examples(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = [{k: v for k, v in r.items() if k != "meta"} for r in ROWS]
    mapping = FieldMapping(prompt="question", answer="solution", extra=["level"], uid="id")
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(flat))
    (tmp_path / "d.csv").write_text("question,solution,level,id\n" + "".join(
        f"{r['question']},{r['solution']},{r['level']},{r['id']}\n" for r in flat))
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "hf_dir"))
    reference = load_examples(write_jsonl(tmp_path / "d.jsonl", flat), mapping)
    for name in ("d.parquet", "d.json", "hf_dir"):
        assert load_examples(tmp_path / name, mapping) == reference, name
    from_csv = load_examples(tmp_path / "d.csv", mapping)  # csv has no types: level is "1"
    assert [e.prompt for e in from_csv] == [e.prompt for e in reference]
    assert load_examples(tmp_path / "d.jsonl", mapping, format="hf") == reference


def test_prompt_template(tmp_path):
    mapping = FieldMapping(prompt_template="Q: {question} (level {level})", answer="solution")
    [ex] = load_examples(write_jsonl(tmp_path / "d.jsonl", ROWS[:1]), mapping)
    assert ex.prompt == "Q: 1+1? (level 1)"


@pytest.mark.parametrize("lines,message", [
    (['{"question": "a", "solution": "1"}', '{"question": "b"'], r"d\.jsonl:2: malformed JSON"),
    (['{"question": "a", "solution": "1"}', '{"solution": "2"}'],
     r"d\.jsonl line 2: missing field 'question' \(fields present: solution\)"),
    (['{"question": "a", "solution": "1"}', '{"question": "  ", "solution": "2"}'],
     r"d\.jsonl line 2: empty prompt"),
    (['{"question": "a", "solution": ""}'], r"d\.jsonl line 1: empty answer"),
    (['[1, 2]'], r"d\.jsonl:1: expected a JSON object"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, lines, message):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=message):
        load_examples(path, FieldMapping(prompt="question", answer="solution"))


def test_missing_file_nested_field_duplicate_uid_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_examples(tmp_path / "nope.jsonl")
    rows = [dict(ROWS[0], meta={}), ROWS[1]]
    with pytest.raises(DatasetError, match=r"line 1: missing field 'meta.src'"):
        load_examples(write_jsonl(tmp_path / "a.jsonl", rows), MAPPING)
    with pytest.raises(DatasetError, match=r"row 1: duplicate uid 'q0'"):
        load_examples(write_jsonl(tmp_path / "b.jsonl", [ROWS[0], ROWS[0]]), MAPPING)
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(DatasetError, match="format"):
        load_examples(tmp_path / "c.txt")


def _uids(ds, n):
    return [ds.next().uid for _ in range(n)]


def test_seeded_shuffle_is_deterministic_and_reshuffles_per_epoch():
    from asyncrl.types import Example
    examples = [Example(prompt=f"p{i}", answer=str(i), uid=str(i)) for i in range(20)]
    a, b = ExampleDataset(examples, seed=7), ExampleDataset(examples, seed=7)
    first_epoch = _uids(a, 20)
    assert first_epoch == _uids(b, 20)
    assert sorted(first_epoch, key=int) == [str(i) for i in range(20)]  # a permutation
    assert first_epoch != [str(i) for i in range(20)]
    assert _uids(a, 20) != first_epoch  # epoch 1 has its own order
    assert _uids(ExampleDataset(examples, seed=8), 20) != first_epoch
    assert _uids(ExampleDataset(examples, shuffle=False), 3) == ["0", "1", "2"]


def test_resume_continues_exactly_across_epochs():
    from asyncrl.types import Example
    examples = [Example(prompt=f"p{i}", answer=str(i), uid=str(i)) for i in range(7)]
    straight = ExampleDataset(examples, seed=3)
    expected = _uids(straight, 30)
    first = ExampleDataset(examples, seed=3)
    head = _uids(first, 11)  # stops inside epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = ExampleDataset(examples, seed=3)
    resumed.load_state_dict(state)
    assert head + _uids(resumed, 19) == expected
    with pytest.raises(ValueError, match="seed"):
        ExampleDataset(examples, seed=4).load_state_dict(state)
    stream = iter(ExampleDataset(examples, shuffle=False))
    assert [next(stream).uid for _ in range(9)] == [str(i) for i in range(7)] + ["0", "1"]  # endless


@pytest.mark.skipif(not DATA.exists(), reason="asyncrl/data/sets not present")
def test_reference_data_sets_load_with_their_mappings():
    gsm8k = load_dataset(DATA / "gsm8k" / "test.jsonl", GSM8K, seed=0)
    assert len(gsm8k) == 1319 and "####" in gsm8k[0].answer
    assert gsm8k[0].prompt.startswith("Janet") and gsm8k[0].prompt.endswith('after "####".')
    minerva = load_dataset(DATA / "math_eval" / "minerva_math.jsonl", MINERVA)
    assert len(minerva) == 272 and "\\boxed" in minerva[0].answer
    amc = load_examples(DATA / "math_eval" / "amc23.jsonl", preset_mapping("amc23"))
    assert amc[0].answer == "27"  # the float 27.0, as text
    assert amc[0].prompt.endswith("put your final answer within \\boxed{}.")
    with pytest.raises(KeyError, match="presets: aime24"):
        preset_mapping("gsm8")


def test_empty_question_inside_a_prompt_template_is_refused(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": " ", "answer": "3"}\n')
    mapping = FieldMapping(prompt="question", answer="answer", prompt_template="Question: {question}\nAnswer:")
    with pytest.raises(DatasetError, match=r"q\.jsonl line 2: empty prompt \(field 'question'\)"):
        load_examples(path, mapping)
