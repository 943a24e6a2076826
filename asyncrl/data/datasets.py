"""Prompt datasets: local files (jsonl, json, parquet, csv), HF ``save_to_disk`` directories,
and datasets on the Hugging Face Hub by id (``openai/gsm8k``).

    rows (dicts) ──FieldMapping──► Example(prompt, answer, fields, uid) ──► ExampleDataset

* ``FieldMapping`` says which row field is the prompt (or a ``prompt_template`` over
  the row), which is the answer, and which extra fields reach the reward functions.
* Every row is validated when the dataset is loaded, before training starts: a
  malformed line, a missing field or an empty prompt is an error naming the file,
  the row (and the line for jsonl) and the field.
* ``ExampleDataset`` yields examples in a seeded order, reshuffled each epoch, and
  resumes exactly from ``state_dict()`` (epoch + position).

* A ``DatasetDict`` (a ``save_to_disk`` directory, a Hub dataset) is read one split at a time
  (``split``: ``train`` for training, ``test`` for the held-out set).

Why these dependencies: jsonl/json/csv need only the standard library; parquet is
read with pyarrow (columnar, no pandas); HF ``datasets`` is imported only for a
directory written by ``save_to_disk``, a Hub id, or when ``format="hf"`` is asked for,
because importing it costs about a second. A Hub id goes through ``datasets.load_dataset``
as in every peer framework: downloaded once into the HF cache (``HF_HOME``), then read from
there, offline too (``HF_HUB_OFFLINE=1``).
"""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from asyncrl.hub import is_hub_id
from asyncrl.types import Example

FORMATS = ("jsonl", "json", "parquet", "csv", "hf")


class DatasetError(ValueError):
    """Bad data found while loading; the message names file, row and field."""


class MissingSplitError(DatasetError):
    """A dataset dict has no split of the requested name (e.g. no ``test`` split)."""


@dataclass
class FieldMapping:
    """Where an ``Example``'s parts come from in a row.

    ``extra`` maps row fields to the keyword names rewards receive (a list keeps the
    names). Dotted names reach into nested dicts (``"meta.level"``). The answer is
    also passed to rewards, as ``fields["answer"]``.
    """

    prompt: str = "prompt"
    answer: Optional[str] = "answer"
    extra: Union[dict[str, str], list[str]] = field(default_factory=dict)
    uid: Optional[str] = None  # a row field used as uid; default "<file name>:<row>"
    prompt_template: Optional[str] = None  # e.g. "{question}\nAnswer after ####."

    def extra_items(self) -> list[tuple[str, str]]:
        if isinstance(self.extra, dict):
            return list(self.extra.items())
        return [(name, name) for name in self.extra]


# -- reading rows -------------------------------------------------------------------

def detect_format(path: Path) -> str:
    """The format implied by a path: a directory is an HF ``save_to_disk`` dataset."""
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".json", ".parquet", ".csv"):
        return suffix[1:]
    raise DatasetError(f"{path}: cannot tell the format from the extension; pass format= one of {FORMATS}")


def read_rows(path: Union[str, Path], format: Optional[str] = None, split: str = "train",
              subset: Optional[str] = None) -> list[tuple[str, dict]]:
    """``(location, row)`` pairs; ``location`` is "line 7" (jsonl) or "row 6" for errors.
    ``split`` picks a split of a dataset dict (a ``save_to_disk`` directory, a Hub id);
    ``subset``: a Hub dataset's configuration (gsm8k's ``main``)."""
    if is_hub_id(path):
        return _read_hub(str(path), subset, split)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path} (resolved: {path.resolve()})")
    fmt = format or detect_format(path)
    readers = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet,
               "csv": _read_csv, "hf": lambda p: _read_hf(p, split)}
    if fmt not in readers:
        raise DatasetError(f"{path}: unknown format {fmt!r}; expected one of {FORMATS}")
    try:
        return readers[fmt](path)
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}): a "
                           f"binary file with a .{fmt} name?") from None


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: malformed JSON line ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append((f"line {lineno}", row))
    return rows


def _read_json(path: Path) -> list[tuple[str, dict]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of objects (or {{'data': [...]}})")
    return _numbered(path, data)


def _read_csv(path: Path) -> list[tuple[str, dict]]:
    with open(path, encoding="utf-8", newline="") as fh:
        # csv rows start on line 2 (after the header), for messages only
        return [(f"line {i + 2}", dict(row)) for i, row in enumerate(csv.DictReader(fh))]


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:  # ArrowInvalid: not parquet, truncated, corrupt footer
        raise DatasetError(f"{path}: not a readable parquet file ({str(err).splitlines()[0]})") from None
    return _numbered(path, table.to_pylist())


def _import_datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{what} needs the datasets package: pip install 'asyncrl[tasks]'") from None
    return datasets


def _read_hf(path: Path, split: str = "train") -> list[tuple[str, dict]]:
    """A ``save_to_disk`` directory (a ``DatasetDict``: its ``split``), or a data file read by
    ``datasets.load_dataset``."""
    datasets = _import_datasets(f"reading {path}")

    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise MissingSplitError(f"{path}: a DatasetDict without a {split!r} split "
                                        f"(splits: {', '.join(loaded)}); set data.split / data.eval_split")
            loaded = loaded[split]
    else:
        builder = {"jsonl": "json", "ndjson": "json"}.get(path.suffix[1:].lower(), path.suffix[1:].lower())
        loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
    return _numbered(path, list(loaded))


def _read_hub(repo_id: str, subset: Optional[str], split: str) -> list[tuple[str, dict]]:
    """One split of a Hub dataset through ``datasets.load_dataset`` (cached under ``HF_HOME``)."""
    datasets = _import_datasets(f"data.path={repo_id!r} (a Hub dataset id)")

    where = repo_id + (f" ({subset})" if subset else "")
    try:
        loaded = datasets.load_dataset(repo_id, subset, split=split)
    except ValueError as err:
        if "split" in str(err).lower() and "config" not in str(err).lower():
            raise MissingSplitError(f"{where}: no {split!r} split ({err}); set data.split / data.eval_split") from None
        raise DatasetError(f"{where}: {err} (a Hub dataset with several configurations needs data.subset)") from None
    except (FileNotFoundError, ConnectionError, OSError) as err:
        raise DatasetError(f"{repo_id!r} is not a local file or directory, and loading it from the Hugging Face "
                           f"Hub failed: {err}") from None
    return _numbered(Path(repo_id), list(loaded))


def _numbered(path: Path, rows: list) -> list[tuple[str, dict]]:
    out = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{path} row {index}: expected an object, got {type(row).__name__}")
        out.append((f"row {index}", row))
    return out


# -- rows to examples ---------------------------------------------------------------

def _get(row: dict, name: str, where: str) -> Any:
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            present = ", ".join(sorted(map(str, row))) or "none"
            raise DatasetError(f"{where}: missing field {name!r} (fields present: {present})")
        value = value[part]
    return value


def _answer_text(value: Any) -> str:
    """Answers as text; integral floats (AMC's 27.0) become "27"."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def row_to_example(row: dict, mapping: FieldMapping, where: str, default_uid: str) -> Example:
    """One validated ``Example``; ``where`` ("data.jsonl line 7") prefixes errors."""
    if mapping.prompt_template is not None:
        try:
            prompt = mapping.prompt_template.format(**row)
        except KeyError as err:
            present = ", ".join(sorted(map(str, row)))
            raise DatasetError(f"{where}: prompt_template uses missing field {err.args[0]!r} "
                               f"(fields present: {present})") from None
    else:
        prompt = _get(row, mapping.prompt, where)
    # a template can wrap an empty question in non-empty text: check the field itself too
    raw_prompt = row.get(mapping.prompt, prompt) if mapping.prompt and isinstance(row, dict) else prompt
    for text in (prompt, raw_prompt):
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{where}: empty prompt (field {mapping.prompt!r})")
    answer = ""
    if mapping.answer is not None:
        raw = _get(row, mapping.answer, where)
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            raise DatasetError(f"{where}: empty answer (field {mapping.answer!r})")
        answer = _answer_text(raw)
    fields = {target: _get(row, source, where) for source, target in mapping.extra_items()}
    fields["answer"] = answer
    uid = str(_get(row, mapping.uid, where)) if mapping.uid else default_uid
    return Example(prompt=prompt, answer=answer, fields=fields, uid=uid)


def load_examples(path: Union[str, Path], mapping: Optional[FieldMapping] = None,
                  format: Optional[str] = None, limit: Optional[int] = None, split: str = "train",
                  subset: Optional[str] = None) -> list[Example]:
    """Read and validate every row of ``path`` (the first ``limit`` rows if given); a dataset
    dict's ``split`` (see :func:`read_rows`)."""
    mapping = mapping or FieldMapping()
    rows = read_rows(path, format, split, subset)
    path = Path(path)
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise DatasetError(f"{path}: no rows")
    examples = [row_to_example(row, mapping, f"{path} {loc}", f"{path.name}:{i}")
                for i, (loc, row) in enumerate(rows)]
    if mapping.uid:
        seen: dict[str, int] = {}
        for i, ex in enumerate(examples):
            if ex.uid in seen:
                raise DatasetError(f"{path} row {i}: duplicate uid {ex.uid!r} (first at row {seen[ex.uid]})")
            seen[ex.uid] = i
    return examples


# -- iteration ----------------------------------------------------------------------

class ExampleDataset:
    """An endless stream of examples in a seeded order, reshuffled every epoch, resumable.

    ``next(ds)`` (or ``ds.next()``) never stops: the runtime draws prompts from it;
    ``ds.examples`` is the file order (for evaluation). ``ds.epoch`` counts rollovers.

    Order of epoch e: ``random.Random(seed + e)`` shuffles the indices (the file
    order when ``shuffle=False``). The state is ``(epoch, position)``: the next
    example is ``order(epoch)[position]``, so a resumed run yields exactly what the
    uninterrupted one would have.
    """

    def __init__(self, examples: list[Example], shuffle: bool = True, seed: int = 0):
        if not examples:
            raise DatasetError("a dataset needs at least one example")
        self.examples = examples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next(self) -> Example:
        """The next example, rolling over into a new, reshuffled epoch."""
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        example = self.examples[self._order[self.position]]
        self.position += 1
        return example

    def next_batch(self, n: int) -> list[Example]:
        """``n`` examples (an epoch boundary may fall inside the batch)."""
        return [self.next() for _ in range(n)]

    def __iter__(self) -> Iterator[Example]:
        return self

    __next__ = next

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "size": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; refuses a state saved from a different dataset or order."""
        for key in ("size", "seed", "shuffle"):
            mine = {"size": len(self.examples), "seed": self.seed, "shuffle": self.shuffle}[key]
            if key in state and state[key] != mine:
                raise ValueError(f"dataset state has {key}={state[key]!r} but this dataset has {mine!r}; "
                                 "resuming would replay a different order")
        if not 0 <= state["position"] <= len(self.examples):
            raise ValueError(f"dataset state position {state['position']} out of range")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)


def load_dataset(path: Union[str, Path], mapping: Optional[FieldMapping] = None,
                 format: Optional[str] = None, shuffle: bool = True, seed: int = 0,
                 limit: Optional[int] = None, split: str = "train", subset: Optional[str] = None) -> ExampleDataset:
    """Load, validate and wrap a dataset (file, directory or Hub id): the one call a recipe needs."""
    return ExampleDataset(load_examples(path, mapping, format, limit, split, subset), shuffle=shuffle, seed=seed)


def examples_from_rows(rows, mapping: Optional[FieldMapping] = None, name: str = "dataset") -> list[Example]:
    """Validated examples from rows given as Python objects: a list of dicts, an HF ``Dataset``
    (what a TRL user passes), or ready ``Example`` objects (the Python API's datasets)."""
    rows = list(rows)
    if rows and all(isinstance(r, Example) for r in rows):
        return rows
    mapping = mapping or FieldMapping()
    if not rows:
        raise DatasetError(f"{name}: no rows")
    return [row_to_example(dict(row), mapping, f"{name} row {i}", f"{name}:{i}") for i, row in enumerate(rows)]


# Presets for the data sets that ship in asyncrl/data/sets (see its README), with the
# prompts their evaluations use: GSM8K's "####" answer line, Qwen2.5-Math's \boxed{}.
GSM8K_PROMPT = "{question}\nLet's think step by step and output the final answer after \"####\"."
BOXED_PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."

GSM8K = FieldMapping(prompt="question", answer="answer", prompt_template=GSM8K_PROMPT)
MATH_EVAL = FieldMapping(prompt="problem", answer="answer", prompt_template=BOXED_PROMPT)
# Minerva has no answer field: the reference is the solution, whose \boxed{} the math
# reward extracts.
MINERVA = FieldMapping(prompt="problem", answer="solution", prompt_template=BOXED_PROMPT)

PRESETS = {"gsm8k": GSM8K, "aime24": MATH_EVAL, "amc23": MATH_EVAL, "math_eval": MATH_EVAL,
           "minerva_math": MINERVA}


def preset_mapping(name: str) -> FieldMapping:
    """The ``FieldMapping`` of a named preset (a copy: callers may change it)."""
    if name not in PRESETS:
        raise KeyError(f"unknown dataset preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    import dataclasses

    return dataclasses.replace(PRESETS[name])
