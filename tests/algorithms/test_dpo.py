import math

import pytest
import torch

from asyncrl.algorithms import dpo_loss


def test_policy_equal_to_reference_gives_log_two():
    # h = 0 -> −log σ(0) = log 2, whatever the smoothing
    z = torch.zeros(3)
    for eps in (0.0, 0.1):
        loss, m = dpo_loss(z, z, z, z, beta=0.1, label_smoothing=eps)
        assert loss.item() == pytest.approx(math.log(2))
    assert m["rewards/margin"] == 0.0 and m["rewards/accuracy"] == 0.0


def test_hand_values_and_metrics():
    # chosen: policy −1 vs ref −2 -> reward β·1 = 0.5; rejected: −3 vs −2 -> −0.5
    # h = (−1 − (−3)) − (−2 − (−2)) = 2; loss = −log σ(β·h) = −log σ(1) ≈ 0.3133
    pc = torch.tensor([-1.0], requires_grad=True)
    loss, m = dpo_loss(pc, torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-1))))
    assert m == pytest.approx({"rewards/chosen": 0.5, "rewards/rejected": -0.5,
                               "rewards/accuracy": 1.0, "rewards/margin": 1.0})
    loss.backward()
    # ∂/∂lp_c = −β·(1 − σ(β·h)) = −0.5·(1 − σ(1))
    assert pc.grad.item() == pytest.approx(-0.5 * (1 - 1 / (1 + math.exp(-1))))


def test_label_smoothing_matches_formula():
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(8, generator=gen, dtype=torch.float64) for _ in range(4))
    beta, eps = 0.2, 0.1
    expected = 0.0
    for i in range(8):
        h = float((pc[i] - pr[i]) - (rc[i] - rr[i]))
        sig = 1 / (1 + math.exp(-beta * h))
        expected += -(1 - eps) * math.log(sig) - eps * math.log(1 - sig)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    assert loss.item() == pytest.approx(expected / 8)
