"""What a draft head's acceptance WILL be in the engine, computed offline (no engine).

Greedy EAGLE speculation on a greedy sample is deterministic: a round that starts with ``L``
tokens drafts token ``L + j`` with ``EagleHead.unrolled`` pass ``j + 1`` at position ``L - 1 + j``
(``spec/eagle.py``: the catch-up is pass 1, draft step j is pass j + 1, each attending to the
true-feature entries before its chain and to its own chain), the verifier accepts the drafts up
to the first one that differs from the sample's next token, and the next round starts at
``L + accepted + 1``. ``replay_acceptance`` walks those rounds over the passes' argmaxes, so
on the target's own greedy continuations it gives the engine's acceptance rate and tokens per
target pass (up to float ties) without running the engine.

Why it exists: ``train_head``'s ``agree_j`` is measured on the batches it trains on. A head
that memorised its samples (a random-weight target gives token sequences with nothing to
generalise from) reports a high agreement there and ~0 acceptance on new prompts; the replay on
held-out samples says which, and the replay on the engine's own generations checks the engine.
"""
from __future__ import annotations

import numpy as np
import torch

from asyncrl.engine.spec.eagle_head import EagleHead
from asyncrl.training.draft_head import DraftSample, pad_samples, policy_inputs


@torch.no_grad()
def pass_hits(head: EagleHead, policy, ids: torch.Tensor, passes: int) -> torch.Tensor:
    """Bool ``[passes, B, T]``: pass j + 1's argmax at position p equals ``ids[:, p + 1]`` (False at
    the last position, which predicts nothing)."""
    feats, embeds = policy_inputs(policy, ids)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
        outs = head.unrolled(embeds, feats, passes)
    weight = policy.lm_head.weight
    hits = torch.zeros(passes, *ids.shape, dtype=torch.bool, device=ids.device)
    for j, g in enumerate(outs):
        pred = lm_head_argmax(g, weight)
        hits[j, :, :-1] = pred[:, :-1] == ids[:, 1:]
    return hits


def lm_head_argmax(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """argmax of the LM head over ``g [B, T, H]`` -> ``[B, T]``, one row at a time (a 150k
    vocabulary over thousands of positions does not fit as one ``[B, T, V]``)."""
    return torch.stack([(g[b].to(weight.dtype) @ weight.t()).argmax(-1) for b in range(g.shape[0])])


def walk_rounds(hits: np.ndarray, start: int, end: int, k: int) -> tuple[int, int, int]:
    """(rounds, drafted, accepted) of greedy speculation over one sample: ``hits [k, T]`` of its
    passes, the first round after prefill at ``start`` tokens (the prompt + the prefill's token),
    ``end`` its length; drafts per round capped as the scheduler's budget (every token must fit)."""
    rounds = drafted = accepted = 0
    L = start
    while L < end:
        budget = min(k, end - L - 1)
        a = 0
        while a < budget and hits[a, L - 1 + a]:
            a += 1
        rounds, drafted, accepted = rounds + 1, drafted + budget, accepted + a
        L += a + 1
    return rounds, drafted, accepted


def replay_acceptance(head: EagleHead, policy, samples: list[DraftSample], k: int, batch_size: int = 8) -> dict:
    """Greedy speculation with ``k`` drafts replayed over ``samples`` (each the policy's greedy
    continuation of its prompt): the engine's ``acceptance_rate`` and ``tokens_per_target_pass``,
    plus ``agree_j`` (pass j's argmax agreement over every completion position, as ``train_head``
    reports it but on these samples)."""
    device = next(policy.parameters()).device
    head.eval()
    rounds = drafted = accepted = 0
    agree, counted = np.zeros(k), 0
    for i in range(0, len(samples), batch_size):
        chunk = samples[i:i + batch_size]
        ids, mask = pad_samples(chunk, device)  # mask: the completion positions, as train_head counts them
        hits, mask = pass_hits(head, policy, ids, k).cpu().numpy(), mask.cpu().numpy()
        agree += (hits & mask).sum((1, 2))
        counted += int(mask.sum())
        for b, s in enumerate(chunk):
            r, d, a = walk_rounds(hits[:, b], s.num_prompt + 1, len(s.token_ids), k)
            rounds, drafted, accepted = rounds + r, drafted + d, accepted + a
    return dict(acceptance_rate=round(accepted / max(drafted, 1), 4),
                tokens_per_target_pass=round((rounds + accepted) / max(rounds, 1), 4),
                rounds=rounds, drafted=drafted, accepted=accepted,
                **{f"agree_{j + 1}": round(float(agree[j]) / max(counted, 1), 4) for j in range(k)})
