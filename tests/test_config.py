"""Config loading, overrides, and every kind of config error (the key is always named)."""
import pytest

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config


def test_quickstart_recipe_loads_with_its_values():
    cfg = load_config("quickstart")
    assert cfg.name == "quickstart"
    assert cfg.rollout.n == 8 and cfg.rollout.max_tokens == 6
    assert cfg.task.name == "arithmetic" and cfg.task.operations == ["+"]


def test_defaults_without_recipe():
    cfg = load_config(None)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.clip_ratio_c == 3.0


def test_dotted_overrides_are_typed():
    cfg = load_config("quickstart", ["algorithm.kl_coef=0.01", "rollout.n=4", "logging.tensorboard=false",
                                     "task.operations=[+, '-']", "model.path=null"])
    assert cfg.algorithm.kl_coef == 0.01 and cfg.rollout.n == 4
    assert cfg.logging.tensorboard is False and cfg.task.operations == ["+", "-"]
    assert cfg.model.path is None


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["actor.lr=1"]).actor.lr == 1.0
    with pytest.raises(ConfigError, match=r"rollout\.n: expected an integer"):
        load_config(None, ["rollout.n=2.5"])


@pytest.mark.parametrize("override, message", [
    ("algorithm.kl_coeff=0.1", r"unknown config key 'algorithm.kl_coeff' \(did you mean 'algorithm.kl_coef'\?\)"),
    ("rolout.n=4", r"unknown config key 'rolout.n' \(did you mean 'rollout.n'\?\)"),
    ("rollout.n=0", r"rollout\.n: 0 is out of range \(must be >= 1\)"),
    ("rollout.top_p=1.5", r"rollout\.top_p: 1\.5 is out of range \(must be <= 1\)"),
    ("rollout.temperature=abc", r"rollout\.temperature: expected a number"),
    ("logging.tensorboard=3", r"logging\.tensorboard: expected true or false"),
    ("algorithm.loss_agg_mode=token_mean", r"algorithm\.loss_agg_mode: 'token_mean' is not one of .*did you mean 'token-mean'"),
    ("task.min_digits=5", r"task\.min_digits must be <= task\.max_digits"),
    ("actor.mini_batches=3", r"actor\.mini_batches=3 must divide"),
    ("novalue", r"not of the form key\.path=value"),
])
def test_bad_overrides_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("quickstart", [override])


def test_unknown_key_in_a_recipe_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("rollout:\n  n: 4\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.temprature' \(did you mean 'rollout.temperature'\?\)"):
        load_config(str(recipe))


def test_recipe_that_is_not_a_mapping(tmp_path):
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(recipe))


def test_missing_recipe_lists_the_known_ones():
    with pytest.raises(ConfigError, match="recipe 'nope' not found .*quickstart"):
        load_config("nope")


def test_cli_refuses_before_running(capsys):
    assert main(["train", "algorithm.kl_coeff=0.1"]) == 2
    assert "did you mean 'algorithm.kl_coef'" in capsys.readouterr().err


def test_cli_print_config_shows_the_resolved_tree(capsys):
    assert main(["print-config", "quickstart", "rollout.n=3"]) == 0
    out = capsys.readouterr().out
    assert "n: 3" in out and "name: quickstart" in out


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimator=grop", r"algorithm\.adv_estimator: 'grop' is not one of .*did you mean 'grpo'"),
    ("algorithm.policy_loss=ppo-clip", r"algorithm\.policy_loss: 'ppo-clip' .*did you mean 'ppo_clip'"),
    ("algorithm.kl_estimator=k4", r"algorithm\.kl_estimator: 'k4' is not one of"),
])
def test_unregistered_algorithm_names_are_refused_before_running(override, message, capsys):
    from asyncrl.runtime.validate import check_registered_names
    with pytest.raises(ConfigError, match=message):
        check_registered_names(load_config("quickstart", [override]))
    assert main(["train", override]) == 2


def test_scientific_notation_without_a_dot_is_a_float(tmp_path):
    # YAML 1.1 reads 1e-3 as a string; users write it anyway.
    assert load_config(None, ["actor.lr=2e-4"]).actor.lr == 2e-4
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  lr: 3e-5\n")
    assert load_config(str(recipe)).actor.lr == 3e-5


@pytest.mark.parametrize("override", ["actor.lr=.inf", "actor.lr=.nan", "algorithm.clip_ratio_c=inf",
                                      "trainer.max_wall_seconds=.inf"])
def test_non_finite_numbers_are_refused(override, capsys):
    """.inf passes every range check (inf > 0): accepted, it turned every weight NaN at step 1."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: .* is not a finite number"):
        load_config(None, [override])
    assert main(["train", override]) == 2 and "not a finite number" in capsys.readouterr().err


def test_master_dtype_is_float32_or_the_models_own():
    from asyncrl.runtime.validate import validate_config

    validate_config(load_config(None, ["model.dtype=bfloat16"]))  # default: fp32 master weights
    validate_config(load_config(None, ["model.dtype=bfloat16", "actor.master_dtype=bfloat16"]))  # pure bf16
    with pytest.raises(ConfigError, match="actor.master_dtype=bfloat16 with model.dtype=float32"):
        validate_config(load_config(None, ["actor.master_dtype=bfloat16"]))
