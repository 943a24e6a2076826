"""DPO training (Rafailov et al., arXiv 2305.18290): the policy against a frozen reference.

Each preference pair (prompt, chosen, rejected) becomes two rows of one padded batch,
chosen rows first; a response's log-prob is the sum over its tokens (answer + EOS), the
quantity the Bradley-Terry model of DPO compares. The loss is ``asyncrl.algorithms.dpo_loss``
(sigmoid, optional label smoothing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncrl.algorithms import dpo_loss
from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.logprobs import response_logprobs
from asyncrl.training.reference import Reference


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


def pair_batch(pairs: list[PreferencePair], tokenizer):
    """Rows [chosen_0..chosen_{B-1}, rejected_0..rejected_{B-1}]: input_ids / attention_mask
    [2B, P + L], response_mask [2B, L], P. Responses end with EOS, as in SFT."""
    prompts = [tokenizer(p.prompt)["input_ids"] for p in pairs]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    responses = [encode(p.chosen) for p in pairs] + [encode(p.rejected) for p in pairs]
    return pad_prompt_response(prompts + prompts, responses, tokenizer.pad_token_id)


def sequence_logprobs(model, input_ids, attention_mask, response_mask, prompt_length: int,
                      chunk_tokens: int) -> torch.Tensor:
    """[rows] Σ_t log π(response token t): the log-probability of each whole response."""
    device = next(model.parameters()).device
    lp, _ = response_logprobs(model, input_ids.to(device), attention_mask.to(device), prompt_length,
                              chunk_tokens=chunk_tokens)
    return (lp * response_mask.to(device)).sum(-1)


class DPOTrainer:
    """Policy + AdamW + a frozen copy of the initial policy as the reference.

    Invariant: the reference never changes, so at step 0 every implicit reward
    β·(log π − log π_ref) is exactly 0 (margin 0, loss log 2).
    """

    def __init__(self, model, dpo_cfg, micro_pairs: int, chunk_tokens: int):
        self.model, self.cfg, self.micro_pairs, self.chunk_tokens = model, dpo_cfg, micro_pairs, chunk_tokens
        self.reference = Reference(model, 1.0, micro_pairs * 2, chunk_tokens).model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=dpo_cfg.lr)
        warmup = dpo_cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

    def _loss(self, pairs: list[PreferencePair], tokenizer) -> tuple[torch.Tensor, dict[str, float]]:
        ids, attn, mask, plen = pair_batch(pairs, tokenizer)
        size = len(pairs)
        with torch.no_grad():
            ref = sequence_logprobs(self.reference, ids, attn, mask, plen, self.chunk_tokens)
        policy = sequence_logprobs(self.model, ids, attn, mask, plen, self.chunk_tokens)
        return dpo_loss(policy[:size], policy[size:], ref[:size], ref[size:], self.cfg.beta, self.cfg.label_smoothing)

    def step(self, pairs: list[PreferencePair], tokenizer) -> dict[str, float]:
        """One optimizer step on ``pairs``. Micro-batch losses are weighted by their share of
        the pairs, so they sum to exactly the batch's mean loss."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for start in range(0, len(pairs), self.micro_pairs):
            micro = pairs[start:start + self.micro_pairs]
            share = len(micro) / len(pairs)
            loss, stats = self._loss(micro, tokenizer)
            (loss * share).backward()
            for key, value in {"dpo/loss": loss.item(), **{f"dpo/{k}": v for k, v in stats.items()}}.items():
                sums[key] = sums.get(key, 0.0) + value * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if math.isfinite(float(grad_norm)):
            self.optimizer.step()
        self.scheduler.step()
        return {**sums, "dpo/grad_norm": float(grad_norm), "dpo/lr": self.scheduler.get_last_lr()[0]}

    @torch.no_grad()
    def evaluate(self, pairs: list[PreferencePair], tokenizer) -> dict[str, float]:
        """Loss and implicit-reward accuracy / margin on held-out pairs (no update)."""
        self.model.eval()
        sums: dict[str, float] = {}
        for start in range(0, len(pairs), self.micro_pairs):
            micro = pairs[start:start + self.micro_pairs]
            loss, stats = self._loss(micro, tokenizer)
            for key, value in {"loss": loss.item(), **stats}.items():
                sums[f"dpo_eval/{key}"] = sums.get(f"dpo_eval/{key}", 0.0) + value * len(micro) / len(pairs)
        return sums
