"""A fresh clone, without ../shared beside it and without ASYNCRL_DATA_DIR, runs the dataset
recipes as a new user types them:

    asyncrl train gsm8k_grpo_cpu trainer.steps=5
    asyncrl eval eval_math

The clone is the repository's files copied into a temporary folder (no ``shared`` sibling),
imported from there in a subprocess. The recipes name models on the Hugging Face Hub; with no
network here, the subprocess runs with ``HF_HUB_OFFLINE=1`` over an HF cache that holds a tiny
random model under those Hub ids (tests/hub_cache.py), which is how the Hub path is exercised:
``snapshot_download`` / ``from_pretrained`` read it exactly as after a real download. The data
(GSM8K, AIME 2024) must come from inside the package. The same process also runs an eval whose
``data.path`` is a Hub dataset id (its ``test`` split is the held-out set) and whose
``model.path`` is the train run's directory. Overrides only shrink the work (eval.k,
eval.max_tokens, data.eval_limit, reward.num_workers), never where data or models come from.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hub_cache  # tests/hub_cache.py (tests/ is on sys.path: it has no __init__.py)

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, pathlib, sys
import asyncrl
from asyncrl.cli import main

assert pathlib.Path(asyncrl.__file__).resolve().parents[1] == pathlib.Path.cwd().resolve(), asyncrl.__file__
common = ["logging.output_dir=runs", "logging.progress=false", "logging.report=false"]
assert main(["train", "gsm8k_grpo_cpu", "trainer.steps=5", *common]) == 0
assert main(["eval", "eval_math", "eval.k=2", "eval.max_tokens=8", "data.eval_limit=4", "reward.num_workers=2",
             *common]) == 0
[train_run] = pathlib.Path("runs").glob("*-train-gsm8k_grpo_cpu")
assert main(["eval", "gsm8k_grpo_cpu", f"model.path={train_run}", "data.path=openai/gsm8k", "data.subset=main",
             "reward.num_workers=1", *common]) == 0
'''


def _clone(dest: Path) -> Path:
    """The repository's files (tracked, and new ones git does not ignore) copied to ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: cannot tell the repository's files")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _gsm8k_rows(split: str, n: int) -> list[dict]:
    from asyncrl.data.sources import SHIPPED_DATA

    lines = (SHIPPED_DATA / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def test_a_fresh_clone_without_shared_runs_the_dataset_recipes(tmp_path, tiny_chat_checkpoint):
    clone = _clone(tmp_path / "work" / "asyncrl")
    assert not (clone.parent / "shared").exists()
    hf_home = tmp_path / "hf"
    for repo_id in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-Math-1.5B-Instruct"):
        hub_cache.add_model(hf_home, repo_id, tiny_chat_checkpoint)
    hub_cache.add_dataset(hf_home, "openai/gsm8k", "main", {"train": _gsm8k_rows("train", 16),
                                                           "test": _gsm8k_rows("test", 6)})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCRL_", "HF_", "PYTHONPATH"))}
    env.update(PYTHONPATH=str(clone), HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", ASYNCRL_CACHE=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [train_run] = (clone / "runs").glob("*-train-gsm8k_grpo_cpu")
    summary = json.loads((train_run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["source"] == "gsm8k"
    assert summary["model_path"].endswith("0" * 40)  # the Hub snapshot of Qwen/Qwen2.5-0.5B-Instruct
    [math_run] = (clone / "runs").glob("*-eval-eval_math")
    report = json.loads((math_run / "eval.json").read_text())
    assert report["data"] == "aime24" and report["metrics"]["num_prompts"] == 4  # AIME 2024 from the package
    [hub_run] = (clone / "runs").glob("*-eval-gsm8k_grpo_cpu")
    report = json.loads((hub_run / "eval.json").read_text())
    assert report["metrics"]["num_prompts"] == 6  # the Hub DatasetDict's test split
    assert "checkpoints" in report["model"]       # the train run's latest checkpoint
    assert "Traceback" not in done.stderr
