"""Every algorithm recipe runs end to end on a tiny model: a few steps, finite metrics, and
the recipe's own metrics present (critic, dynamic sampling, KL in the reward)."""
import json
import math
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.runtime.pipeline import run_training
from tests.runtime.test_pipeline import FAST

RECIPE_METRICS = {
    "grpo": ["actor/kl_loss"],
    "dr_grpo": [],
    "dapo": ["dynamic_sampling/rounds", "dynamic_sampling/kept_group_fraction"],
    "gspo": [],
    "sapo": [],
    "ppo": ["critic/vf_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean",
            "time/critic_update"],
    "rloo": ["kl/reward_kl", "kl/reward_coef"],
    "reinforce_pp": ["kl/reward_kl", "kl/reward_coef"],
    "quickstart_lora": [],  # rank-16 PEFT adapters at the measured LoRA lr (only they train and sync)
    "quickstart_qwen3_5": [],  # Qwen3.5's hybrid layers: engine rollouts (state slots), HF training, weight sync
}
# A 5-step SFT model is almost never right, so "acc" would be constant in every group;
# the length-shaped score varies, which keeps DAPO's dynamic sampling exercised.
TINY_MODEL_FIXES = {"dapo": ["algorithm.filter_groups.metric=score", "algorithm.overlong_buffer.len=6"],
                    # FAST's 2 layers would both be Gated DeltaNet: 4 = 3 GDN + the gated-attention layer
                    "quickstart_qwen3_5": ["model.tiny.num_hidden_layers=4"]}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("warm_start_cache")  # one SFT warm start for all recipes


@pytest.mark.parametrize("recipe", sorted(RECIPE_METRICS))
def test_recipe_runs_end_to_end(recipe, cache_dir, tmp_path):
    overrides = [*FAST, "trainer.steps=2", "logging.tensorboard=false", f"sft.cache_dir={cache_dir}",
                 f"logging.run_dir={tmp_path / 'run'}", *TINY_MODEL_FIXES.get(recipe, [])]
    summary = run_training(load_config(recipe, overrides))
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ["reward/mean", "actor/pg_loss", "actor/grad_norm", *RECIPE_METRICS[recipe]]:
        assert all(isinstance(r[key], float) and math.isfinite(r[key]) for r in rows), key
    if recipe.endswith("_lora"):  # adapters trained, saved in PEFT's format (no full weights)
        saved = {p.name for p in Path(summary["checkpoint"]).iterdir()}
        assert "adapter_config.json" in saved and "model.safetensors" not in saved, saved
