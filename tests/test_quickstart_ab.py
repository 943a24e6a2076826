"""bench/quickstart_ab.py at toy size: two checkouts (here the same commit twice) run as a user runs
them, in pairs, each run's RL seconds and stages read back and the pair ratio formed."""
import importlib.util
import json
import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quickstart_ab.py"
TOY = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
       "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.prompts_per_step=4",
       "rollout.n=4", "task.num_eval=16", "logging.progress=false", "logging.tensorboard=false",
       "logging.report=false", "trainer.eval_samples=0"]


def test_pairs_of_the_same_commit(tmp_path):
    spec = importlib.util.spec_from_file_location("quickstart_ab", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--base", "HEAD", "--head", "HEAD", "--pairs", "2", "--steps", "2", "--workdir",
                      str(tmp_path), "--json", str(tmp_path / "ab.json"), "--set", *TOY])
    assert out["commits"]["base"] == out["commits"]["head"] and out["mode"] == "concurrent"
    assert sorted((r["pair"], r["name"]) for r in out["runs"]) == [(0, "base"), (0, "head"), (1, "base"), (1, "head")]
    assert all(r["rl_seconds"] > 0 and r["actor_update"] > 0 and r["rollout"] > 0 for r in out["runs"])
    assert len(out["pair_ratios"]) == 2 and all(x > 0 for x in out["pair_ratios"])
    assert json.loads((tmp_path / "ab.json").read_text())["mean_ratio"] == out["mean_ratio"]
    assert min(out["pair_ratios"]) <= out["median_ratios"]["head"] <= max(out["pair_ratios"])
    subprocess.run(["git", "-C", str(BENCH.parents[1]), "worktree", "remove", "--force",
                    str(tmp_path / "trees" / out["commits"]["head"])], capture_output=True)


def test_a_run_imports_its_own_checkout(tmp_path):
    """``python -m`` puts the working directory first on sys.path: a run started inside another
    checkout would silently run that checkout's code; the bench checks and refuses."""
    import pytest

    spec = importlib.util.spec_from_file_location("quickstart_ab", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    repo = BENCH.parents[1]
    other = tmp_path / "other"
    (other / "asyncrl").mkdir(parents=True)
    (other / "asyncrl" / "__init__.py").write_text("")
    with pytest.raises(SystemExit, match="would import asyncrl from"):
        bench.checked_import(other, repo)  # cwd = the repository: its asyncrl comes first
    bench.checked_import(other, tmp_path)


def test_more_commits_pinned_in_waves(tmp_path):
    """``--also`` runs a third commit beside base and head; ``--cores`` pins each run to a core of its
    own, in waves when there are more runs than cores (here 3 runs on 2 cores)."""
    spec = importlib.util.spec_from_file_location("quickstart_ab", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--base", "HEAD", "--head", "HEAD", "--also", "HEAD", "--pairs", "1", "--steps", "2",
                      "--cores", "0-1", "--workdir", str(tmp_path), "--set", *TOY])
    assert out["mode"] == "pinned" and set(out["ratios"]) == {"head", "HEAD"}
    assert sorted(r["name"] for r in out["runs"]) == ["HEAD", "base", "head"]
    assert all(len(v) == 1 and v[0] > 0 for v in out["ratios"].values())
    assert set(out["stage_ratios"]["HEAD"]) >= {"rl_seconds", "rollout", "actor_update"}
    subprocess.run(["git", "-C", str(BENCH.parents[1]), "worktree", "remove", "--force",
                    str(tmp_path / "trees" / out["commits"]["head"])], capture_output=True)
