import pytest

from asyncrl.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, Registry


def test_register_get_aliases_and_names():
    reg = Registry("thing")

    @reg.register("alpha", "a")
    def alpha():
        return 1

    assert reg.get("alpha") is alpha and reg.get("a") is alpha
    assert reg.names() == ["a", "alpha"] and "a" in reg and len(reg) == 2


def test_duplicate_registration_is_an_error():
    reg = Registry("thing")
    reg.register("x")(lambda: 0)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x")(lambda: 1)


def test_unknown_key_names_key_and_closest_valid_names():
    reg = Registry("advantage estimator")
    for name in ("grpo", "rloo", "gae"):
        reg.register(name)(lambda: 0)
    with pytest.raises(ValueError) as err:
        reg.get("gpro")
    msg = str(err.value)
    assert "'gpro'" in msg and "did you mean 'grpo'" in msg and "advantage estimator" in msg
    with pytest.raises(ValueError, match="valid: gae, grpo, rloo"):
        reg.get("zzzzzz")


def test_required_keys_are_registered():
    assert {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae",
            "opo", "gpg"} <= set(ADV_ESTIMATORS.names())
    assert {"ppo_clip", "gspo", "sapo", "cispo", "pg", "gpg"} <= set(POLICY_LOSSES.names())
    assert {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k3+"} <= set(KL_ESTIMATORS.names())
