"""Reward-model reward: a local HF ``AutoModelForSequenceClassification`` checkpoint.

    score = logits[label_index] of the (prompt, response) conversation

The text scored is the tokenizer's chat template over ``[user: prompt, assistant:
response]`` when it has one (reward models are trained on that format), else
``prompt + response``. Scoring is batched (``RewardModel.score_batch``); the pool
calls the batched entry point ``reward_model_batch`` once per submitted group.

Loaded models are cached per process by (path, device, dtype), so a pool worker
loads its model once, on its first call.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence


class RewardModel:
    """A sequence-classification model that scores (prompt, response) pairs."""

    def __init__(self, path: str, device: str = "cpu", dtype: Optional[str] = None,
                 max_length: int = 4096, batch_size: int = 8, label_index: int = 0,
                 use_chat_template: Optional[bool] = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
        self.model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs).to(device).eval()
        if self.tokenizer.pad_token is None:
            # Right padding needs a pad id; the model finds each sequence's last real
            # token through config.pad_token_id, so they must agree.
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.tokenizer.padding_side = "right"
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.max_length = max_length
        self.batch_size = batch_size
        self.label_index = label_index
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.use_chat_template = has_template if use_chat_template is None else use_chat_template

    def text(self, prompt: str, response: str) -> str:
        """The string the model scores."""
        if not self.use_chat_template:
            return prompt + response
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One float per pair, computed ``batch_size`` pairs at a time."""
        import torch

        texts = [self.text(p, r) for p, r in zip(prompts, responses)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=True, max_length=self.max_length, add_special_tokens=False)
            with torch.inference_mode():
                logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits
            scores.extend(logits[:, self.label_index].float().cpu().tolist())
        return scores


@functools.lru_cache(maxsize=4)
def load_reward_model(path: str, device: str = "cpu", dtype: Optional[str] = None,
                      **kwargs: Any) -> RewardModel:
    """A cached ``RewardModel`` (one per worker process and configuration)."""
    return RewardModel(path, device=device, dtype=dtype, **kwargs)


def reward_model(prompt: str, response: str, model_path: str = "", device: str = "cpu",
                 dtype: Optional[str] = None, **fields: Any) -> float:
    """Per-sample reward contract; prefer the batched ``reward_model_batch``."""
    return reward_model_batch([prompt], [response], [fields], model_path=model_path,
                              device=device, dtype=dtype)[0]


def reward_model_batch(prompts: list[str], responses: list[str], fields: list[dict],
                       model_path: str = "", device: str = "cpu", dtype: Optional[str] = None,
                       batch_size: int = 8) -> list[float]:
    """Batched reward contract: ``(prompts, responses, fields) -> scores``."""
    if not model_path:
        raise ValueError("reward_model needs model_path (RewardSpec kwargs={'model_path': ...})")
    model = load_reward_model(model_path, device, dtype, batch_size=batch_size)
    return model.score_batch(prompts, responses)


reward_model_batch.batched = True  # tells RewardPool to call it once per group
