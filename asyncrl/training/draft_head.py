"""Training an EAGLE draft head on the policy's own samples (``asyncrl train-draft``).

The policy is frozen; its features (the last hidden state after the final norm, the input of
its LM head: ``policy.model(ids).last_hidden_state``) and next-token distributions are the
targets. Loss (EAGLE-3's training-time test, arXiv 2503.01840): for each pass j = 1..passes
of ``EagleHead.unrolled`` (pass 1 reads the true features, pass j > 1 its own previous outputs,
as drafting step j does), the cross-entropy of the head's next-token distribution against the
policy's full distribution (soft labels: what the verifier accepts is p(draft); or ``label="token"``:
the sample's own next token), averaged over the completion positions every pass can draft from. No feature-regression term (EAGLE-3
dropped it: the head need not reproduce features it is not scored on).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from asyncrl.engine.spec.eagle_head import EagleHead


@dataclass
class DraftSample:
    """One policy sample: ``token_ids`` = prompt + completion, the first ``num_prompt`` the prompt."""
    token_ids: list[int]
    num_prompt: int


def pad_samples(samples: list[DraftSample], device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids ``[B, T]`` (right-padded with 0) and the loss mask ``[B, T]``: position p predicts token
    p + 1, counted when that token is part of the completion."""
    T = max(len(s.token_ids) for s in samples)
    ids = torch.zeros(len(samples), T, dtype=torch.long)
    mask = torch.zeros(len(samples), T, dtype=torch.bool)
    for i, s in enumerate(samples):
        ids[i, :len(s.token_ids)] = torch.tensor(s.token_ids)
        mask[i, max(s.num_prompt - 1, 0):len(s.token_ids) - 1] = True
    return ids.to(device), mask.to(device)


@torch.no_grad()
def policy_inputs(policy, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's inputs from the frozen policy: features (its last hidden state after the final
    norm) and token embeddings, both ``[B, T, H]`` fp32."""
    feats = policy.model(input_ids=ids).last_hidden_state.float()
    return feats, policy.get_input_embeddings()(ids).float()


def head_loss(head: EagleHead, policy, ids: torch.Tensor, mask: torch.Tensor, passes: int,
              label: str = "soft") -> tuple[torch.Tensor, list[float]]:
    """(loss, per-pass top-1 agreement with the policy's argmax) on one batch ``ids [B, T]``.
    ``label``: ``soft`` = cross-entropy against the policy's distribution; ``token`` = against the
    sample's own next token (for greedy samples: the policy's argmax, the only thing a greedy
    verifier checks; it matters when the distribution is nearly flat, as a random model's is)."""
    feats, embeds = policy_inputs(policy, ids)
    with torch.no_grad():
        target = policy.lm_head(feats.to(policy.lm_head.weight.dtype)).float()  # [B, T, V]
        best = target.argmax(-1)
        p_target = F.softmax(target, -1) if label == "soft" else None
        del target
    # on CUDA the head and its logits run in bf16 (autocast; the softmaxes stay fp32): a 150k
    # vocabulary over thousands of positions per pass is most of the step
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
        outs = head.unrolled(embeds, feats, passes)
    loss, agree = 0.0, []
    for j, g in enumerate(outs):
        m = mask.clone()
        m[:, :j] = False  # pass j + 1 drafts from position j on (its chain needs j earlier entries)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            logits = F.linear(g, policy.lm_head.weight.to(g.dtype))
        logq = F.log_softmax(logits.float(), -1)
        if label == "soft":
            ce = -(p_target * logq).sum(-1)
        else:
            ce = -logq[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            ce = torch.cat([ce, ce.new_zeros(ce.shape[0], 1)], dim=1)  # the last position predicts nothing
        loss = loss + (ce * m).sum() / m.sum().clamp(min=1)
        with torch.no_grad():
            hit = (logq.argmax(-1) == best) & m
            agree.append(float(hit.sum() / m.sum().clamp(min=1)))
    return loss / len(outs), agree


def train_head(head: EagleHead, policy, samples: list[DraftSample], steps: int, batch_size: int, lr: float,
               passes: int, seed: int = 0, on_step: Optional[Callable[[int, dict], None]] = None,
               label: str = "soft") -> dict:
    """AdamW on the head's parameters (the policy stays frozen), cosine decay to 10% of ``lr``
    after a 5% warm-up; returns the final metrics (loss, per-pass argmax agreement, seconds)."""
    if not samples:
        raise ValueError("train-draft: no samples to train the draft head on")
    device = next(policy.parameters()).device
    head.train()
    for p in policy.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1)))))
    rng = random.Random(seed)
    t0, metrics = time.perf_counter(), {}
    for step in range(steps):
        ids, mask = pad_samples(rng.sample(samples, min(batch_size, len(samples))), device)
        loss, agree = head_loss(head, policy, ids, mask, passes, label)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        metrics = {"loss": float(loss.detach()), **{f"agree_{j + 1}": a for j, a in enumerate(agree)}}
        if on_step is not None:
            on_step(step, metrics)
    head.eval()
    return {**metrics, "seconds": round(time.perf_counter() - t0, 2), "steps": steps}
