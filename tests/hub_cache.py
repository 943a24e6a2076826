"""An offline Hugging Face cache holding a model and a dataset under Hub ids, as a download
would leave it, so the Hub-id paths (``model.path=Qwen/...``, ``data.path=openai/gsm8k``) are
tested without a network: the code under test runs with ``HF_HOME`` pointing here and
``HF_HUB_OFFLINE=1`` (set in a subprocess: both libraries read them when imported).

Layouts (huggingface_hub and datasets' own):
  models:   $HF_HOME/hub/models--<org>--<name>/{refs/main, snapshots/<commit>/<files>}
  datasets: $HF_HOME/datasets/<org>___<name>/<subset>/0.0.0/<commit>/{dataset_info.json, <name>-<split>.arrow}
"""
from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0" * 40


def add_model(hf_home: Path, repo_id: str, checkpoint: Path) -> Path:
    """The files of ``checkpoint`` as the cached snapshot of ``repo_id``; returns the snapshot dir."""
    repo = Path(hf_home) / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def add_dataset(hf_home: Path, repo_id: str, subset: str, splits: dict[str, list[dict]]) -> Path:
    """``splits`` ({split: rows}) prepared by datasets' own parquet builder, filed as the cache
    of ``repo_id``/``subset``; returns the prepared directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    name = repo_id.split("/")[-1]
    work = Path(hf_home) / "build" / name
    work.mkdir(parents=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(work / f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), files[split])
    builder = Parquet(cache_dir=str(work / "cache"), dataset_name=name, config_name=subset, data_files=files)
    builder.download_and_prepare()
    prepared = Path(hf_home) / "datasets" / repo_id.replace("/", "___") / subset / "0.0.0" / COMMIT
    prepared.mkdir(parents=True)
    for path in Path(builder.cache_dir).iterdir():
        if path.suffix in (".arrow", ".json"):
            shutil.copy(path, prepared / path.name)
    shutil.rmtree(work)
    return prepared
