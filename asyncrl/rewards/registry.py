"""Reward functions by name: ``register_reward`` and ``resolve_reward``.

The reward contract is a plain function::

    fn(prompt: str, response: str, **fields) -> float | None

``fields`` are the dataset row's extra fields (``answer`` included), so a reward sees
the ground truth without any framework types. ``None`` means "no opinion" (the pool
records it and uses its default score).

A config refers to a reward by a registered name (``"math"``) or by an import path
(``"my_pkg.rewards:length_penalty"``). Built-in rewards are listed lazily, by import
path, so that resolving ``"format"`` never imports torch or math-verify.
"""
from __future__ import annotations

import difflib
import importlib
from typing import Callable, Optional

RewardFn = Callable[..., Optional[float]]

# name -> function, filled by @register_reward (user code and tests).
_REGISTRY: dict[str, RewardFn] = {}

# name -> "module:function" for the built-ins, imported on first use.
_BUILTINS: dict[str, str] = {
    "math": "asyncrl.rewards.math:math_reward",
    "gsm8k": "asyncrl.rewards.math:math_reward",
    "format": "asyncrl.rewards.format:think_answer_format",
    "think_answer_format": "asyncrl.rewards.format:think_answer_format",
    "regex": "asyncrl.rewards.format:regex_reward",
    "code": "asyncrl.rewards.code:code_reward",
    "reward_model": "asyncrl.rewards.model:reward_model_batch",
    "judge": "asyncrl.rewards.judge:judge_reward",
}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator that makes ``fn`` resolvable as ``name``.

    Re-registering the same function under its name is allowed (module reloads);
    a different function under a taken name is an error, because silently replacing
    a reward changes what a run optimises.
    """

    def decorator(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        if existing is not None and _qualname(existing) != _qualname(fn):
            raise ValueError(
                f"reward name {name!r} is already registered to {_qualname(existing)}; "
                f"cannot register {_qualname(fn)} under the same name"
            )
        _REGISTRY[name] = fn
        return fn

    return decorator


def registered_names() -> list[str]:
    """Every name ``resolve_reward`` accepts without an import path."""
    return sorted(set(_REGISTRY) | set(_BUILTINS))


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """The reward function that ``spec`` names.

    ``spec`` is a callable (returned as is), a registered or built-in name, or
    ``"module:function"``. Errors name the spec and, for typos, the closest names.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a name or 'module:function', got {spec!r}")
    spec = spec.strip()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if spec in _BUILTINS:
        return _import_path(_BUILTINS[spec], spec)
    if ":" in spec:
        return _import_path(spec, spec)
    close = difflib.get_close_matches(spec, registered_names(), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise KeyError(
        f"unknown reward {spec!r}.{hint} Registered rewards: {', '.join(registered_names())}. "
        "A user function is referenced as 'module:function' (the module must be importable)."
    )


def _import_path(path: str, spec: str) -> RewardFn:
    """Import ``module:function``; explain failures in terms of the user's spec."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward spec {spec!r} must look like 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ImportError(
            f"reward {spec!r}: cannot import module {module_name!r} ({err}). "
            "Is it installed or on PYTHONPATH (run from the directory that contains it)?"
        ) from err
    except Exception as err:  # the module itself raised while importing
        raise ImportError(
            f"reward {spec!r}: importing module {module_name!r} raised "
            f"{type(err).__name__}: {err}"
        ) from err
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            public = [n for n in dir(module) if not n.startswith("_")]
            close = difflib.get_close_matches(attr, public, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise AttributeError(
                f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}.{hint}"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"reward {spec!r}: {path} is a {type(fn).__name__}, not a function")
    return fn


def _qualname(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
