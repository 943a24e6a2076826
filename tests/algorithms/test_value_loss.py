import pytest
import torch

from asyncrl.algorithms import compute_value_loss, global_counts

from . import reference as ref


def test_hand_values():
    # token 0: V = 2, V_old = 1, R = 0, ε = 0.5 -> V_clip = 1.5; max(4, 2.25) = 4 (not clipped)
    # token 1: V = 2, V_old = 1, R = 3           -> V_clip = 1.5; max(1, 2.25) = 2.25 (clipped)
    # loss = 0.5 · (4 + 2.25)/2 = 1.5625; vf_clipfrac = 1/2
    values = torch.tensor([[2.0, 2.0]], requires_grad=True)
    loss, m = compute_value_loss(values, torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 3.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(1.5625) and m["vf_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # token 0: ∂/∂V 0.5·(V − R)²/2 = (2 − 0)/2 = 1; token 1: clipped branch is flat in V
    torch.testing.assert_close(values.grad, torch.tensor([[1.0, 0.0]]))


def test_in_band_values_are_never_counted_as_clipped():
    # |V − V_old| < ε = 1 on every token: V_clip = V exactly, so (V_clip − R)² > (V − R)² never
    # holds. The old V_old + clamp(V − V_old) is not V when |V_old| ≪ |V| (the difference rounds):
    # here it counted ~1% of these in-band tokens as clipped.
    gen = torch.Generator().manual_seed(0)
    old = 0.01 * torch.randn(128, 128, generator=gen)
    values = (0.2 * torch.randn(128, 128, generator=gen)).clamp(-0.9, 0.9)
    returns = torch.randn(128, 128, generator=gen)
    _, m = compute_value_loss(values, old, returns, torch.ones(128, 128), cliprange_value=1.0)
    assert m["vf_clipfrac"] == 0.0


def test_seq_mean_token_sum_norm_uses_the_loss_scale_factor():
    # one row, V = 1, V_old = 1, R = 0 on 2 of 4 tokens: Σ_t (V − R)² = 2, S = 1
    # 0.5·2/(1·L_norm): L_norm = 8 -> 0.125 (the padded length 4 would give 0.25)
    values = torch.ones(1, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    loss, _ = compute_value_loss(values, values, torch.zeros(1, 4), mask, loss_agg_mode="seq-mean-token-sum-norm",
                                 loss_scale_factor=8.0)
    assert loss.item() == 0.125
    loss, _ = compute_value_loss(values, values, torch.zeros(1, 4), mask, loss_agg_mode="seq-mean-token-sum-norm")
    assert loss.item() == 0.25


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_matches_reference_and_micro_batches_sum(mode):
    gen = torch.Generator().manual_seed(0)
    v, vo, R = (torch.randn(6, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(6, 5, generator=gen) < 0.7).double()
    want_mat = torch.zeros(6, 5, dtype=torch.float64)
    for i in range(6):
        for t in range(5):
            vc = min(max(float(v[i, t]), float(vo[i, t]) - 0.5), float(vo[i, t]) + 0.5)
            want_mat[i, t] = max((float(v[i, t]) - float(R[i, t])) ** 2, (vc - float(R[i, t])) ** 2)
    full, _ = compute_value_loss(v, vo, R, mask, loss_agg_mode=mode)
    assert full.item() == pytest.approx(0.5 * ref.agg(want_mat, mask, mode))
    tokens, seqs = global_counts(mask)
    parts = [compute_value_loss(v[s], vo[s], R[s], mask[s], loss_agg_mode=mode,
                                global_tokens=tokens, global_seqs=seqs)[0] for s in (slice(0, 4), slice(4, 6))]
    torch.testing.assert_close(sum(parts), full)
