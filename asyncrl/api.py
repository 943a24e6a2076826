"""The Python API: ``asyncrl.train(...)`` and ``Trainer``, over the config tree the CLI uses.

    import asyncrl

    summary = asyncrl.train("quickstart", trainer={"steps": 200}, rollout={"n": 4})
    summary = asyncrl.train("quickstart", **{"algorithm.kl_coef": 0.01})   # dotted keys, as on the CLI

    def brevity(prompt, response, **fields):                                 # TRL-style reward function
        return 1.0 if len(response) < 200 else 0.0

    trainer = asyncrl.Trainer("gsm8k_grpo_cpu", reward_funcs=["math", brevity],
                              train_dataset=[{"question": ..., "answer": ...}, ...],  # dicts, an HF Dataset, Examples
                              trainer={"steps": 10})
    trainer.config.actor.lr = 2e-6    # the typed config (asyncrl/config.py), until train() runs
    summary = trainer.train()         # what summary.json holds; trainer.run_dir is the run directory

``config_or_recipe`` is a recipe name or path, a :class:`~asyncrl.config.Config`, a dict tree,
or None (the defaults). Overrides are the config's own keys: a section as a dict
(``trainer={"steps": 5}``, merged into the recipe's section) or a dotted key; every key is
checked like the CLI's (a typo names the closest key). Reward functions are plain callables
``fn(prompt, response, **fields) -> float | None`` or registered names, mixed freely; datasets
rows are mapped to prompts by ``data.*`` exactly as a file would be (presets included).
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from asyncrl.config import Config, load_config
from asyncrl.config_schema import ConfigError, all_keys, build_dataclass, closest_key, to_dict

RewardFunc = Union[str, dict, Callable[..., Optional[float]]]


def train(config_or_recipe: Union[str, Path, Config, dict, None] = None, *, reward_funcs=None,
          train_dataset=None, eval_dataset=None, **overrides: Any) -> dict:
    """Run one RL training job (``asyncrl train``) and return its summary (see :class:`Trainer`)."""
    return Trainer(config_or_recipe, reward_funcs=reward_funcs, train_dataset=train_dataset,
                   eval_dataset=eval_dataset, **overrides).train()


class Trainer:
    """One training job: the typed config, optional Python reward functions and datasets.

    Invariant: ``config`` is a validated :class:`Config` (the same tree ``asyncrl train`` and
    ``print-config`` show); ``train()`` runs it once and keeps ``summary`` and ``run_dir``.
    """

    def __init__(self, config_or_recipe: Union[str, Path, Config, dict, None] = None, *,
                 reward_funcs: Union[RewardFunc, Sequence[RewardFunc], None] = None,
                 train_dataset: Optional[Iterable] = None, eval_dataset: Optional[Iterable] = None,
                 **overrides: Any):
        self.config = build_config(config_or_recipe, overrides)
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        self.reward_funcs = [f for f in funcs if f is not None]
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.summary: Optional[dict] = None

    @property
    def run_dir(self) -> Optional[Path]:
        return Path(self.summary["run_dir"]) if self.summary else None

    def train(self) -> dict:
        """Validate the config, build the prompt source, run the job; returns the summary."""
        from asyncrl.runtime.pipeline import run_training
        from asyncrl.runtime.validate import validate_config

        validate_config(self.config)
        self.summary = run_training(self.config, source=self._source())
        return self.summary

    def _source(self):
        """The recipe's own source unless Python objects replace its rewards or its data."""
        from asyncrl.data.sources import build_prompt_source

        if not (self.reward_funcs or self.train_dataset is not None or self.eval_dataset is not None):
            return build_prompt_source(self.config)
        return python_source(self.config, self.reward_funcs, self.train_dataset, self.eval_dataset)


def build_config(config_or_recipe: Union[str, Path, Config, dict, None] = None,
                 overrides: Optional[Mapping[str, Any]] = None) -> Config:
    """A validated :class:`Config` from a recipe / config / dict tree and Python overrides."""
    if isinstance(config_or_recipe, Config):
        tree = to_dict(config_or_recipe)
    elif isinstance(config_or_recipe, Mapping):
        tree = to_dict(build_dataclass(Config, dict(config_or_recipe)))
    else:
        tree = to_dict(load_config(str(config_or_recipe) if config_or_recipe is not None else None))
    for key, value in _flatten(overrides or {}).items():
        _set(tree, key.split("."), value)
    return build_dataclass(Config, tree)


def _sections(cls=Config, prefix: str = "") -> set[str]:
    """Dotted names of the config's sections (dataclasses), whose dict overrides are merged."""
    import dataclasses
    import typing

    out = set()
    for name, sub in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(sub):
            key = f"{prefix}{name}"
            out |= {key} | _sections(sub, key + ".")
    return out


def _flatten(overrides: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"steps": 5}, "rollout.n": 4}`` -> ``{"trainer.steps": 5, "rollout.n": 4}``;
    a dict for a section is merged key by key, a dict for a dict-valued key is kept whole."""
    valid, sections, flat = all_keys(Config), _sections(), {}
    for name, value in overrides.items():
        key = f"{prefix}{name}"
        if key in sections and isinstance(value, Mapping):
            flat.update(_flatten(value, key + "."))
        elif key in valid and key not in sections:
            flat[key] = value
        else:
            raise ConfigError(f"unknown config key '{key}'{closest_key(key, [k for k in valid if k not in sections])}")
    return flat


def _set(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


# ----------------------------------------------------------------------------- sources


def reward_specs(funcs: Sequence[RewardFunc]):
    """``RewardSpec`` per entry: a callable keeps its ``__name__`` (and a ``weight`` attribute
    if it has one); names and dicts are read as in ``reward.rewards``."""
    from asyncrl.rewards import RewardSpec
    from asyncrl.rewards.build import spec_from_config

    specs = []
    for fn in funcs:
        if callable(fn):
            specs.append(RewardSpec(name=getattr(fn, "__name__", "reward"), fn=fn, weight=getattr(fn, "weight", 1.0)))
        else:
            specs.append(spec_from_config(fn))
    return specs


def _pool_mode(cfg, specs) -> str:
    """``reward.mode``, except that process mode needs picklable functions (module-level ones):
    a lambda or a closure runs in threads instead, said on the console."""
    if cfg.reward.mode != "process":
        return cfg.reward.mode
    unpicklable = [s.name for s in specs if callable(s.fn) and not _picklable(s.fn)]
    if unpicklable:
        from asyncrl.metrics.console import console

        console.print(f"[dim]reward functions {', '.join(unpicklable)} cannot be pickled for worker processes "
                      "(a lambda or a closure): scoring in threads (reward.mode=thread)[/]")
        return "thread"
    return "process"


def _picklable(fn) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return True


def _pool(cfg, funcs: Sequence[RewardFunc]):
    from asyncrl.rewards import RewardPool
    from asyncrl.rewards.extras import missing_reward_dependencies

    specs = reward_specs(funcs or ["math"])
    missing = missing_reward_dependencies(s.fn for s in specs if isinstance(s.fn, str))
    if missing:
        raise ConfigError("; ".join(missing))
    r = cfg.reward
    return RewardPool(specs, mode=_pool_mode(cfg, specs), num_workers=r.num_workers, timeout_s=r.timeout_s,
                      default_score=r.default_score)


def python_source(cfg, reward_funcs: Sequence[RewardFunc], train_dataset=None, eval_dataset=None):
    """A prompt source over Python objects: the rows of ``train_dataset`` / ``eval_dataset``
    (mapped by ``data.*``; without them, the recipe's own data or synthetic task) scored by
    ``reward_funcs`` (without them, the recipe's rewards)."""
    from asyncrl.data.datasets import ExampleDataset, examples_from_rows
    from asyncrl.data.sources import DatasetSource, build_prompt_source, build_reward_pool_from_config, field_mapping

    base = build_prompt_source(cfg)
    if train_dataset is None and eval_dataset is None:  # the recipe's prompts, the user's rewards
        return _with_rewards(base, _pool(cfg, reward_funcs))
    if not cfg.model.path:
        base.close()
        raise ConfigError("a dataset needs a real model: set model.path (a local HF checkpoint, a run directory or "
                          "a Hub id); the built-in tiny model only learns the synthetic task")
    recipe_data = isinstance(base, DatasetSource)
    mapping = field_mapping(cfg.data, cfg.data.preset)
    train = (ExampleDataset(examples_from_rows(train_dataset, mapping, "train_dataset"), cfg.data.shuffle, cfg.seed)
             if train_dataset is not None else getattr(base, "train", None))
    heldout = (examples_from_rows(eval_dataset, mapping, "eval_dataset") if eval_dataset is not None
               else base.heldout_examples() if recipe_data else [])
    if recipe_data and not reward_funcs:
        pool = base.pool  # the recipe's rewards, over the Python rows
    else:
        base.close()
        pool = _pool(cfg, reward_funcs) if reward_funcs else build_reward_pool_from_config(cfg.reward)
    return DatasetSource(train, heldout, pool, cfg.data, name="python")


def _with_rewards(source, pool):
    """``source`` with its rewards replaced by ``pool`` (the synthetic task or a recipe's data)."""
    from asyncrl.data.sources import PoolReward

    previous_close = source.close
    source.reward, source.heldout_reward = PoolReward(pool, record=True), PoolReward(pool, record=False)
    source.step_metrics = source.reward.drain_metrics

    def close() -> None:
        try:
            pool.close()
        finally:
            previous_close()
    source.close = close
    return source
