import math

import pytest
import torch

from asyncrl.algorithms import rollout_is_weights


def test_token_truncate_by_hand():
    # w = π_old/π_roll = [e^{0.5}, e^{1}, e^{−1}]; threshold 2 truncates e ≈ 2.718 to 2
    old = torch.tensor([[0.5, 1.0, -1.0, 0.0]])
    roll = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1, 1, 0]])
    w, m = rollout_is_weights(old, roll, mask)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), 2.0, math.exp(-1), 0.0]]))
    assert m["is_clipped_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_max"] == pytest.approx(math.e, rel=1e-6)
    assert m["mismatch_k1"] == pytest.approx(0.5 / 3)
    # k3 of KL(π_roll‖π_old): mean of ρ − 1 − log ρ over the 3 valid tokens
    k3 = sum(math.exp(x) - 1 - x for x in (0.5, 1.0, -1.0)) / 3
    assert m["mismatch_k3"] == pytest.approx(k3, rel=1e-6)


def test_token_mask_mode_rejects_instead_of_clamping():
    old = torch.tensor([[0.5, 1.0, -1.0]])
    w, _ = rollout_is_weights(old, torch.zeros(1, 3), torch.ones(1, 3), mode="mask")
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), 0.0, math.exp(-1)]]))


def test_sequence_level_by_hand():
    # row 0: Σ(old − roll) = 0.25 + 0.25 = 0.5 -> w = e^{0.5} on both valid tokens
    # row 1: Σ = 1.0 -> e ≈ 2.72 -> truncated to 2 (or 0 with mask)
    old = torch.tensor([[0.25, 0.25, 9.0], [0.5, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    w, _ = rollout_is_weights(old, torch.zeros(2, 3), mask, level="sequence")
    e5 = math.exp(0.5)
    torch.testing.assert_close(w, torch.tensor([[e5, e5, 0.0], [2.0, 2.0, 2.0]]))
    w, _ = rollout_is_weights(old, torch.zeros(2, 3), mask, level="sequence", mode="mask")
    torch.testing.assert_close(w, torch.tensor([[e5, e5, 0.0], [0.0, 0.0, 0.0]]))


def test_weights_are_detached_and_finite():
    old = torch.tensor([[100.0, -100.0]], requires_grad=True)
    w, m = rollout_is_weights(old, torch.zeros(1, 2), torch.ones(1, 2), threshold=5.0)
    assert not w.requires_grad and torch.isfinite(w).all() and w.max() <= 5.0
    assert all(math.isfinite(v) for v in m.values())


def test_identical_policies_give_unit_weights():
    lp = torch.randn(3, 4)
    w, m = rollout_is_weights(lp, lp, torch.ones(3, 4), level="sequence")
    assert (w == 1).all() and m["mismatch_k1"] == 0 and m["is_clipped_frac"] == 0


def test_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="level"):
        rollout_is_weights(x, x, x, level="bogus")
    with pytest.raises(ValueError, match="mode"):
        rollout_is_weights(x, x, x, mode="clip")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_matches_loop_reference(level, mode):
    gen = torch.Generator().manual_seed(7)
    old = torch.randn(5, 6, generator=gen, dtype=torch.float64) * 0.5
    roll = torch.randn(5, 6, generator=gen, dtype=torch.float64) * 0.5
    mask = (torch.rand(5, 6, generator=gen) < 0.7).double()
    want = torch.zeros(5, 6, dtype=torch.float64)
    for i in range(5):
        seq = sum(float(old[i, t] - roll[i, t]) for t in range(6) if mask[i, t] > 0)
        for t in range(6):
            if mask[i, t] == 0:
                continue
            w = math.exp(seq if level == "sequence" else float(old[i, t] - roll[i, t]))
            want[i, t] = min(w, 2.0) if mode == "truncate" else (0.0 if w > 2.0 else w)
    got, _ = rollout_is_weights(old, roll, mask, level=level, mode=mode, threshold=2.0)
    torch.testing.assert_close(got, want)


def test_geometric_level_by_hand():
    # row: old − roll = [0.2, 0.4] -> mean 0.3 -> w = e^{0.3} on both tokens
    w, _ = rollout_is_weights(torch.tensor([[0.2, 0.4, 5.0]]), torch.zeros(1, 3),
                              torch.tensor([[1.0, 1.0, 0.0]]), level="geometric")
    e3 = math.exp(0.3)
    torch.testing.assert_close(w, torch.tensor([[e3, e3, 0.0]]))


def test_lower_threshold_icepop_band():
    # w = [e^{−1} ≈ .37, 1, e ≈ 2.72] with band [0.5, 2]
    old = torch.tensor([[-1.0, 0.0, 1.0]])
    w, m = rollout_is_weights(old, torch.zeros(1, 3), torch.ones(1, 3), mode="mask", lower_threshold=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0]]))
    assert m["is_clipped_frac"] == pytest.approx(2 / 3)
    w, _ = rollout_is_weights(old, torch.zeros(1, 3), torch.ones(1, 3), lower_threshold=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0]]))
    with pytest.raises(ValueError, match="lower_threshold"):
        rollout_is_weights(old, old, torch.ones(1, 3), lower_threshold=3.0)
