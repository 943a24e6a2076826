"""Where prompts come from: one object for the runtime, a synthetic task or a dataset.

    PromptSource
      .train_stream()          endless Examples for rollout
      .heldout_examples()      never-trained-on Examples for accuracy (may be empty)
      .reward                  fn(prompt, response, **fields) (batched through a pool for datasets)
      .heldout_reward          the same reward, whose results stay out of the step metrics
      .prompt_encoder(tok)     Example -> prompt token ids (plain, or the chat template)
      .step_metrics()          reward/<name>, reward/failed_fraction ... since the last call
      .state_dict()            where the training stream is, for checkpoints
      .close()                 stops the reward pool's workers

``build_prompt_source(cfg)`` picks the synthetic task when ``data.path`` and
``data.preset`` are unset (today's quickstart), else loads and validates the dataset
(every row, before any model loads) and starts a ``RewardPool`` over ``reward.rewards``.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from asyncrl.config_schema import ConfigError
from asyncrl.data.datasets import (ExampleDataset, FieldMapping, MissingSplitError, is_hub_id, load_dataset,
                                   load_examples, preset_mapping)
from asyncrl.data.tasks import SyntheticTask, build_task
from asyncrl.data.templates import ChatTemplate
from asyncrl.types import Completion, Example

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The data sets that ship inside the package (asyncrl/data/sets/README.md: sources, licences).
SHIPPED_DATA = Path(__file__).resolve().parent / "sets"
# The preset's (training file, held-out file) under the data root; math_eval has none
# because it is a field mapping for any MATH-style file.
PRESET_FILES = {
    "gsm8k": ("gsm8k/train.jsonl", "gsm8k/test.jsonl"),
    "aime24": ("math_eval/aime24.jsonl", "math_eval/aime24.jsonl"),
    "amc23": ("math_eval/amc23.jsonl", "math_eval/amc23.jsonl"),
    "minerva_math": ("math_eval/minerva_math.jsonl", "math_eval/minerva_math.jsonl"),
}
DEFAULT_DATASET_REWARDS = ["math"]

RewardFn = Callable[..., Optional[float]]
Encoder = Callable[[Example], list[int]]


def data_root() -> Path:
    """Where the presets' files are: ``$ASYNCRL_DATA_DIR`` (another copy, same layout), else the
    sets shipped inside the package, so a plain clone or a pip install has them."""
    return Path(os.environ.get("ASYNCRL_DATA_DIR") or SHIPPED_DATA)


def resolve_data_path(path: str):
    """A data path as given (absolute or from the working directory), else from the repo root,
    so a relative path in a recipe works from any directory; a Hub id (``org/name``, no such
    local path) is returned as is, for ``datasets.load_dataset``."""
    if is_hub_id(path):
        return path
    given = Path(path).expanduser()
    if given.exists() or given.is_absolute():
        return given
    from_repo = REPO_ROOT / given
    return from_repo if from_repo.exists() else given


def preset_file(preset: str, split: int, key: str) -> Path:
    """The preset's training (split 0) or held-out (split 1) file; an error names ``key``."""
    if preset not in PRESET_FILES:
        raise ConfigError(f"{key}={preset!r} is a field mapping without a file of its own: set data.path "
                          f"(presets with files: {', '.join(sorted(PRESET_FILES))})")
    return data_root() / PRESET_FILES[preset][split]


# -- rewards -----------------------------------------------------------------------

def score_responses(reward_fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                    fields: Sequence[dict]) -> list[float]:
    """Scores of many responses: one batched call when ``reward_fn`` has ``score_batch``
    (a pool scores them in parallel), else one call each. ``None`` scores 0."""
    if hasattr(reward_fn, "score_batch"):
        return reward_fn.score_batch(prompts, responses, fields)
    values = (reward_fn(p, r, **f) for p, r, f in zip(prompts, responses, fields))
    return [_finite_or_zero(v) for v in values]


def _finite_or_zero(value) -> float:
    """A reward's value as a float; None, NaN and ±Inf score 0 (a failure, as the pool counts
    them): one non-finite score would make every loss of the step non-finite."""
    number = float(value) if value is not None else 0.0
    return number if math.isfinite(number) else 0.0


def score_completions(reward_fn: RewardFn, example: Example, completions: Sequence[Completion]) -> list[float]:
    """Scores of one prompt's completions; rewards also receive ``finish_reason``."""
    return grade_completions(reward_fn, example, completions)[0]


def grade_responses(reward_fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                    fields: Sequence[dict]) -> tuple[list[float], list[float]]:
    """(scores, correct) of many responses. Correct (1.0 / 0.0) means the task's verifier gave
    full marks: with a reward pool, its first reward (the recipe lists the verifier first)
    reached 1, so a shaping reward listed after it (format, length) adds to the score but never
    makes a wrong answer correct; without a pool, the score reached 1."""
    if hasattr(reward_fn, "grade_batch"):
        return reward_fn.grade_batch(prompts, responses, fields)
    scores = score_responses(reward_fn, prompts, responses, fields)
    return scores, [float(s >= 1.0) for s in scores]


def grade_completions(reward_fn: RewardFn, example: Example,
                      completions: Sequence[Completion]) -> tuple[list[float], list[float]]:
    """:func:`grade_responses` of one prompt's completions (rewards also receive ``finish_reason``).
    Episodes of a workflow (asyncrl.workflows) come scored: their own reward is used as is, and
    an episode is correct when it reached 1."""
    if completions and all(c.reward is not None for c in completions):
        scores = [float(c.reward) for c in completions]
        return scores, [float(s >= 1.0) for s in scores]
    fields = [{**example.fields, "finish_reason": c.finish_reason} for c in completions]
    return grade_responses(reward_fn, [example.prompt] * len(completions), [c.text for c in completions], fields)


class PoolReward:
    """The reward contract over a ``RewardPool``; batches go out as one submission.

    With ``record=True`` it keeps its results until ``drain_metrics()``, so each step
    logs its own ``reward/<name>`` means and ``reward/failed_fraction``.
    """

    def __init__(self, pool, record: bool = True):
        self.pool, self.record = pool, record
        self._results: list = []

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str], fields: Sequence[dict]) -> list[float]:
        return self.grade_batch(prompts, responses, fields)[0]

    def grade_batch(self, prompts: Sequence[str], responses: Sequence[str],
                    fields: Sequence[dict]) -> tuple[list[float], list[float]]:
        """(totals, correct): correct when the pool's first reward (the verifier) reached 1."""
        from asyncrl.rewards import RewardRequest

        requests = [RewardRequest(p, r, dict(f)) for p, r, f in zip(prompts, responses, fields)]
        results = self.pool.score(requests)
        if self.record:
            self._results.extend(results)
        verifier = self.pool.specs[0].name
        return [r.total for r in results], [float(r.components.get(verifier, r.total) >= 1.0) for r in results]

    def __call__(self, prompt: str, response: str, **fields: Any) -> float:
        return self.score_batch([prompt], [response], [fields])[0]

    def drain_metrics(self) -> dict[str, float]:
        """Metrics of the results since the last call (the pool's counters are cumulative)."""
        from asyncrl.rewards import reward_metrics

        results, self._results = self._results, []
        return reward_metrics(results, self.pool.stats()) if results else {}


# -- prompt encoding ---------------------------------------------------------------

def generate_for_examples(backend, encode: Callable[[Example], list[int]], examples: Sequence[Example],
                          params) -> list:
    """One ``RequestOutput`` per example: a backend that runs whole episodes (a workflow:
    ``generate_examples``) takes the examples themselves, any other their prompt ids."""
    if hasattr(backend, "generate_examples"):
        return backend.generate_examples(list(examples), params)
    return backend.generate(encode_batch(encode, examples), params)


def encode_batch(encode: Callable[[Example], list[int]], examples: Sequence[Example]) -> list[list[int]]:
    """Prompt ids of ``examples``: ``encode.batch`` when it has one (:class:`PromptEncoder`)."""
    batch = getattr(encode, "batch", None)
    return batch(examples) if batch is not None else [encode(e) for e in examples]


class PromptEncoder:
    """Example -> prompt token ids: through the chat template, or the plain tokenizer.

    With a chat template the ids come from ``apply_chat_template`` itself, so no second
    BOS is added (Llama's template already starts with one).
    """

    def __init__(self, tokenizer, chat: Optional[ChatTemplate] = None):
        self.tokenizer, self.chat = tokenizer, chat

    def __call__(self, example: Example) -> list[int]:
        if self.chat is not None:
            return self.chat.token_ids(example.prompt)
        return list(self.tokenizer(example.prompt)["input_ids"])

    def batch(self, examples: Sequence[Example]) -> list[list[int]]:
        """``[self(e) for e in examples]``, in one tokenizer call when there is no chat template
        (a fast tokenizer costs ~0.1 ms per call in Python; the rollout encodes every step)."""
        if self.chat is not None or not examples or not getattr(self.tokenizer, "is_fast", False):
            return [self(e) for e in examples]  # only HF fast tokenizers promise list input
        return [list(ids) for ids in self.tokenizer([e.prompt for e in examples])["input_ids"]]

    def text(self, example: Example) -> str:
        """The prompt as the model sees it (for logs and eval records)."""
        return self.chat.render(example.prompt) if self.chat is not None else example.prompt


# -- sources -----------------------------------------------------------------------

class TaskSource:
    """A synthetic task: its exact checker called inline, plain tokenisation, no pool."""

    def __init__(self, task: SyntheticTask, seed: int):
        self.task, self.seed, self.name = task, seed, task.name
        self.reward = self.heldout_reward = task.reward

    def train_stream(self) -> Iterator[Example]:
        return self.task.train_stream(seed=self.seed)

    def heldout_examples(self) -> list[Example]:
        return self.task.eval_examples()

    def prompt_encoder(self, tokenizer) -> PromptEncoder:
        return PromptEncoder(tokenizer)

    def step_metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"source": "task", "name": self.name}  # the stream is a pure function of the seed

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class DatasetSource:
    """A dataset file: a resumable shuffled stream, a held-out set, rewards in a pool."""

    task = None  # no synthetic task: the policy comes from model.path

    def __init__(self, train: Optional[ExampleDataset], heldout: list[Example], pool, data_cfg,
                 name: str = "dataset"):
        self.train, self.heldout, self.pool, self.data_cfg, self.name = train, heldout, pool, data_cfg, name
        self.reward = PoolReward(pool, record=True)
        self.heldout_reward = PoolReward(pool, record=False)

    def train_stream(self) -> Iterator[Example]:
        if self.train is None:
            raise ConfigError("no training data: set data.path or data.preset")
        return self.train

    def heldout_examples(self) -> list[Example]:
        return list(self.heldout)

    def prompt_encoder(self, tokenizer) -> PromptEncoder:
        if not self.data_cfg.use_chat_template:
            return PromptEncoder(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "the tokenizer")
            raise ConfigError(f"data.use_chat_template=true but {name!r} has no chat template (a base model?): "
                              "set data.use_chat_template=false to feed the prompt text as is")
        return PromptEncoder(tokenizer, ChatTemplate(tokenizer, self.data_cfg.system_prompt))

    def step_metrics(self) -> dict[str, float]:
        return self.reward.drain_metrics()

    def state_dict(self) -> dict[str, Any]:
        return {"source": "dataset", "name": self.name,
                "train": self.train.state_dict() if self.train is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.train is not None and state.get("train"):
            self.train.load_state_dict(state["train"])

    def close(self) -> None:
        self.pool.close()


# -- building ----------------------------------------------------------------------

def field_mapping(data_cfg, preset: Optional[str] = None) -> FieldMapping:
    """The preset's mapping (or the defaults) with the ``data.*_field`` keys over it.

    A ``prompt_field`` given without a ``prompt_template`` drops the preset's template,
    which names the preset's own prompt field.
    """
    base = preset_mapping(preset) if preset else FieldMapping()
    changes: dict[str, Any] = {}
    if data_cfg.prompt_field is not None:
        changes.update(prompt=data_cfg.prompt_field, prompt_template=None)
    if data_cfg.prompt_template is not None:
        changes["prompt_template"] = data_cfg.prompt_template
    if data_cfg.answer_field is not None:
        changes["answer"] = data_cfg.answer_field
    if data_cfg.uid_field is not None:
        changes["uid"] = data_cfg.uid_field
    if data_cfg.extra_fields:
        changes["extra"] = dict(data_cfg.extra_fields)
    return dataclasses.replace(base, **changes)


def _train_file(data_cfg) -> Path:
    return resolve_data_path(data_cfg.path) if data_cfg.path else preset_file(data_cfg.preset, 0, "data.preset")


def heldout_file_and_mapping(data_cfg) -> tuple[Optional[Path], Optional[FieldMapping], Optional[str]]:
    """(path, mapping, split) of the held-out set: ``eval_path``, else ``eval_preset``'s file,
    else the training preset's held-out split (gsm8k: test.jsonl), else the ``eval_split`` of
    ``data.path`` when it is a dataset dict (a Hub id or a ``save_to_disk`` directory), else none."""
    if data_cfg.eval_path:
        mapping = preset_mapping(data_cfg.eval_preset) if data_cfg.eval_preset else field_mapping(data_cfg,
                                                                                                data_cfg.preset)
        return resolve_data_path(data_cfg.eval_path), mapping, data_cfg.eval_split
    if data_cfg.eval_preset:
        return (preset_file(data_cfg.eval_preset, 1, "data.eval_preset"), preset_mapping(data_cfg.eval_preset),
                None)
    if data_cfg.preset in PRESET_FILES and not data_cfg.path:
        return preset_file(data_cfg.preset, 1, "data.preset"), field_mapping(data_cfg, data_cfg.preset), None
    if data_cfg.path and _is_dataset_dict(resolve_data_path(data_cfg.path)):
        return resolve_data_path(data_cfg.path), field_mapping(data_cfg, data_cfg.preset), data_cfg.eval_split
    return None, None, None


def _is_dataset_dict(path) -> bool:
    """A Hub id, or a ``save_to_disk`` directory of a ``DatasetDict`` (it has dataset_dict.json)."""
    return isinstance(path, str) or (Path(path) / "dataset_dict.json").is_file()


def load_heldout(data_cfg) -> list[Example]:
    path, mapping, split = heldout_file_and_mapping(data_cfg)
    if path is None:
        return []
    fmt = data_cfg.format if data_cfg.eval_path else None
    try:
        return load_examples(path, mapping, fmt, data_cfg.eval_limit, split=split or "test", subset=data_cfg.subset)
    except MissingSplitError:
        if data_cfg.eval_path:
            raise
        return []  # a dataset dict without a held-out split: as a plain file, no held-out set


def build_reward_pool_from_config(reward_cfg, default: Sequence = DEFAULT_DATASET_REWARDS):
    """The ``RewardPool`` of ``reward.*``; ``default`` rewards when the list is empty."""
    from asyncrl.rewards import build_reward_pool
    from asyncrl.rewards.extras import missing_reward_dependencies

    entries = list(reward_cfg.rewards) or list(default)
    missing = missing_reward_dependencies(e for e in entries if isinstance(e, (str, dict)))
    if missing:  # else every call fails in its worker: a run of zero rewards that exits 0
        raise ConfigError("; ".join(missing))
    try:
        return build_reward_pool(entries, mode=reward_cfg.mode, num_workers=reward_cfg.num_workers,
                                 timeout_s=reward_cfg.timeout_s, default_score=reward_cfg.default_score)
    except (ValueError, ImportError, AttributeError, KeyError) as err:
        raise ConfigError(f"reward.rewards: {err}") from None


def build_prompt_source(cfg, train: bool = True):
    """The source for ``cfg``: the synthetic task, or the dataset (validated now) and its
    reward pool. ``train=False`` (``asyncrl eval``) loads only the held-out set."""
    if not cfg.data.enabled and not (cfg.data.eval_path or cfg.data.eval_preset):
        if cfg.reward.rewards:
            raise ConfigError("reward.rewards applies to datasets: set data.path or data.preset "
                              "(synthetic tasks use their own exact checker)")
        return TaskSource(build_task(cfg.task, cfg.seed), cfg.seed)
    if not cfg.model.path:
        raise ConfigError("a dataset needs a real model: set model.path to a local HF checkpoint directory "
                          "(a Qwen or Llama instruct model); the built-in tiny model only learns synthetic tasks")
    data = cfg.data
    dataset = None
    if train and data.enabled:
        dataset = load_dataset(_train_file(data), field_mapping(data, data.preset), data.format,
                               shuffle=data.shuffle, seed=cfg.seed, limit=data.limit, split=data.split,
                               subset=data.subset)
    heldout = load_heldout(data)
    if not train and not heldout and data.enabled:  # eval of a file without a held-out split: the file
        heldout = load_examples(_train_file(data), field_mapping(data, data.preset), data.format,
                                data.eval_limit or data.limit, split=data.split, subset=data.subset)
    name = data.preset or Path(str(data.path or data.eval_path or data.eval_preset)).stem
    return DatasetSource(dataset, heldout, build_reward_pool_from_config(cfg.reward), data, name=name)
