import pytest

from asyncrl.rewards import registry
from asyncrl.rewards.registry import register_reward, registered_names, resolve_reward


def test_builtin_names_resolve_lazily():
    fn = resolve_reward("format")
    assert fn("", "<think>a</think><answer>b</answer>") == 1.0
    assert "math" in registered_names() and "code" in registered_names()


def test_module_function_spec_and_callable():
    fn = resolve_reward("reward_fixtures:length")
    assert fn("p", "abcd") == 0.4
    assert resolve_reward(fn) is fn


def test_register_and_conflict():
    @register_reward("test_registry_const")
    def const(prompt, response, **fields):
        return 0.5

    assert resolve_reward("test_registry_const") is const
    register_reward("test_registry_const")(const)  # same function again: fine

    def other(prompt, response, **fields):
        return 0.0

    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_registry_const")(other)
    registry._REGISTRY.pop("test_registry_const")


def test_typo_suggests_closest_name():
    with pytest.raises(KeyError, match="unknown reward 'mth'.*'math'"):
        resolve_reward("mth")


def test_import_errors_name_the_spec():
    with pytest.raises(ImportError, match="no_such_module_xyz.*cannot import"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(AttributeError, match="has no attribute 'lenght'.*'length'"):
        resolve_reward("reward_fixtures:lenght")
    with pytest.raises(ValueError):
        resolve_reward("   ")
