"""The Ray executor on a local Ray instance (the package's ``local_ray``): the quickstart runs a
few async steps with the rollout backend and the rewards in Ray actors (their own processes),
bound kept."""
import json
import pytest

ray = pytest.importorskip("ray")

from asyncrl.config import load_config  # noqa: E402
from asyncrl.runtime.pipeline import run_training  # noqa: E402

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=3",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=8", "logging.progress=false",
        "logging.tensorboard=false"]


@pytest.mark.ray
def test_quickstart_async_on_ray(local_ray, tmp_path):
    cfg = load_config("quickstart", FAST + [
        f"logging.run_dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path / 'cache'}",
        "runtime.mode=async", "runtime.executor=ray", "runtime.max_staleness=1",
        "algorithm.decoupled=true", "algorithm.rollout_correction.level=token"])
    summary = run_training(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3
    assert all(r["async/staleness_violations"] == 0 for r in rows)
    assert all(r["weight_sync/probe_gap"] < 1e-3 for r in rows)  # weights reached the actor's process
    assert all(r["weight_sync/probe_delta"] >= 0 for r in rows)
    from ray.util.placement_group import placement_group_table
    table = placement_group_table()
    assert table and all(pg["state"] == "REMOVED" for pg in table.values())  # placed, released at the end
