"""Reading jsonl files of records whose fields must be strings, with errors naming file:line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def read_string_records(path: str, fields: tuple[str, ...], what: str = "file") -> Iterator[tuple[int, dict]]:
    """(line number, row) for every non-blank line of ``path``.

    A missing file, a line that is not JSON, or a row lacking one of ``fields`` as a
    string is refused with a message naming the file, the line and the field.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{what} '{path}' does not exist")
    for line_no, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
        for name in fields:
            if not isinstance(row, dict) or not isinstance(row.get(name), str):
                raise ValueError(f"{path}:{line_no}: missing string field '{name}'")
        yield line_no, row
