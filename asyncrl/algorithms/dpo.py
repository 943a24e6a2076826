"""Direct Preference Optimization loss (Rafailov et al., arXiv 2305.18290)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Sigmoid DPO loss; inputs ``[B]`` are summed log-probs of each full response.

        h = (lp_c − lp_r) − (ref_c − ref_r)
        loss = mean(−(1 − ε)·log σ(β·h) − ε·log σ(−β·h))

    ``label_smoothing`` ε is the conservative DPO of Mitchell (2023), which assumes a
    fraction ε of labels is flipped. The implicit rewards β·(lp − ref) are reported:
    rewards/chosen, rewards/rejected, rewards/accuracy (chosen > rejected), rewards/margin.
    """
    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(
        -beta * logits
    )
    with torch.no_grad():
        chosen = beta * (policy_chosen_logps - ref_chosen_logps)
        rejected = beta * (policy_rejected_logps - ref_rejected_logps)
        stats = torch.stack([
            chosen.mean(),
            rejected.mean(),
            (chosen > rejected).to(chosen.dtype).mean(),
            (chosen - rejected).mean(),
        ]).tolist()
    keys = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")
    return losses.mean(), dict(zip(keys, stats))
