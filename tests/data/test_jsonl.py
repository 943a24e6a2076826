import pytest

from asyncrl.data.demonstrations import load_demonstrations
from asyncrl.data.jsonl import read_string_records


def test_rows_with_their_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "response": "2"}\n\n{"prompt": "2+2=", "response": "4"}\n')
    assert [n for n, _ in read_string_records(str(path), ("prompt", "response"))] == [1, 3]
    assert [ex.answer for ex in load_demonstrations(str(path))] == ["2", "4"]


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "1+1=", "response": "2"}\n{"prompt": "x"\n', r"d\.jsonl:2: not valid JSON"),
    ('{"prompt": "1+1="}\n', r"d\.jsonl:1: missing string field 'response'"),
    ('{"prompt": "1+1=", "response": 2}\n', r"d\.jsonl:1: missing string field 'response'"),
    ('[1, 2]\n', r"d\.jsonl:1: missing string field 'prompt'"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, text, message):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_demonstrations(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="demonstrations file .* does not exist"):
        load_demonstrations(str(tmp_path / "nope.jsonl"))
