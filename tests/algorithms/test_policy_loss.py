import math

import pytest
import torch

from asyncrl.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInput,
    compute_policy_loss,
    global_counts,
)

from . import reference as ref
from .helpers import random_mask


def _tokens(ratios, advantages, **cfg_kw):
    """One row of tokens with given ratios r (old lp = 0, lp = log r) and advantages;
    token-sum aggregation so the loss is the sum of per-token losses."""
    lp = torch.tensor([ratios], dtype=torch.float64).log().requires_grad_(True)
    inp = PolicyLossInput(lp, torch.zeros_like(lp), torch.tensor([advantages], dtype=torch.float64),
                          torch.ones_like(lp))
    return lp, inp, PolicyLossConfig(loss_agg_mode="token-sum", **cfg_kw)


# ---- PPO clip with dual clip: hand-derived (ALGORITHMS.md §11) ---------------------------

@pytest.mark.parametrize(
    "r, A, loss, grad",
    [
        # A = −1, r = 5: L1 = 5, L2 = −(−1)·1.2 = 1.2, Lc = 5, L3 = 3 -> min = 3, flat in r
        (5.0, -1.0, 3.0, 0.0),
        # A = +1, r = 1.5: L1 = −1.5, L2 = −1.2, max = −1.2 (clipped, flat)
        (1.5, 1.0, -1.2, 0.0),
        # A = +1, r = 0.5: L1 = −0.5, L2 = −0.8, max = −0.5 (unclipped: ∂/∂lp = −A·r = −0.5)
        (0.5, 1.0, -0.5, -0.5),
        # A = −1, r = 2: L1 = 2, L2 = 1.2, Lc = 2 < L3 = 3 -> 2, ∂/∂lp = −A·r = 2
        (2.0, -1.0, 2.0, 2.0),
        # A = −1, r = 0.5: L1 = 0.5, L2 = 0.8 -> 0.8 (clipped below, flat)
        (0.5, -1.0, 0.8, 0.0),
    ],
)
def test_ppo_dual_clip_hand_values(r, A, loss, grad):
    lp, inp, cfg = _tokens([r], [A], clip_ratio_c=3.0)
    out = compute_policy_loss("ppo_clip", inp, cfg)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(loss)
    assert lp.grad.item() == pytest.approx(grad, abs=1e-12)


def test_ppo_metrics_by_hand():
    # tokens: (r=5, A=−1) dual-clipped; (r=1.5, A=+1) clipped; (r=0.5, A=+1) free
    _, inp, cfg = _tokens([5.0, 1.5, 0.5], [-1.0, 1.0, 1.0])
    m = compute_policy_loss("ppo_clip", inp, cfg).metrics
    assert m["clipfrac"] == pytest.approx(1 / 3)          # only L2 > L1 at r = 1.5
    assert m["clipfrac_lower"] == pytest.approx(1 / 3)    # r = 5, A < 0
    assert m["ratio_mean"] == pytest.approx(7 / 3)
    assert m["ppo_kl"] == pytest.approx(-(math.log(5) + math.log(1.5) + math.log(0.5)) / 3)


def test_dual_clip_can_be_disabled():
    # without c the A = −1, r = 5 token costs L1 = 5 and keeps its gradient −A·r = 5
    lp, inp, cfg = _tokens([5.0], [-1.0], clip_ratio_c=None)
    out = compute_policy_loss("ppo_clip", inp, cfg)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(5.0) and lp.grad.item() == pytest.approx(5.0)
    assert out.metrics["clipfrac_lower"] == 0.0


def test_asymmetric_clip_higher():
    # DAPO ε_high = 0.28: A = +1, r = 1.5 -> −min(1.5, 1.28) = −1.28
    _, inp, cfg = _tokens([1.5], [1.0], clip_ratio_high=0.28)
    assert compute_policy_loss("ppo_clip", inp, cfg).loss.item() == pytest.approx(-1.28)


def test_on_policy_ppo_gradient_is_policy_gradient():
    # r ≡ 1: clipping never fires, ∂ℓ/∂lp = −A
    lp = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    A = torch.randn(2, 3, dtype=torch.float64)
    inp = PolicyLossInput(lp, lp.detach(), A, torch.ones(2, 3), )
    compute_policy_loss("ppo_clip", inp, PolicyLossConfig(loss_agg_mode="token-sum")).loss.backward()
    torch.testing.assert_close(lp.grad, -A)


def _random_input(seed, B=5, L=6):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(B, L, gen)
    old = -torch.rand(B, L, generator=gen, dtype=torch.float64) * 3
    lp = (old + 0.6 * torch.randn(B, L, generator=gen, dtype=torch.float64)).requires_grad_(True)
    A = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, L).clone()
    A[0, :2] = torch.randn(2, generator=gen, dtype=torch.float64)  # not always sequence-constant
    return PolicyLossInput(lp, old, A, mask)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_ppo_matches_reference(seed, mode):
    inp = _random_input(seed)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
    want_mat = ref.elementwise(lambda lp, old, a: ref.ppo_token(lp, old, a, 0.2, 0.28, 3.0),
                               inp.logprobs.detach(), inp.old_logprobs, inp.advantages)
    got = compute_policy_loss("ppo_clip", inp, cfg).loss.item()
    assert got == pytest.approx(ref.agg(want_mat, inp.response_mask, mode))


# ---- GSPO -------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_gspo_matches_reference_and_forces_seq_mean_token_mean(seed):
    inp = _random_input(seed)
    eps_lo, eps_hi = 3e-2, 4e-2
    want = ref.agg(ref.gspo_loss_matrix(inp.logprobs.detach(), inp.old_logprobs, inp.advantages,
                                        inp.response_mask, eps_lo, eps_hi),
                   inp.response_mask, "seq-mean-token-mean")
    for mode in ("token-mean", "token-sum"):  # the configured mode is ignored
        cfg = PolicyLossConfig(clip_ratio_low=eps_lo, clip_ratio_high=eps_hi, loss_agg_mode=mode)
        assert compute_policy_loss("gspo", inp, cfg).loss.item() == pytest.approx(want)


def test_gspo_gradient_is_sequence_ratio_times_mean_token_gradient():
    # unclipped (wide ε), sequence-constant A: ∂L/∂lp_it = −(1/S)·s_i·A_i·(1/|o_i|)
    gen = torch.Generator().manual_seed(3)
    B, L = 4, 5
    mask = random_mask(B, L, gen, holes=True)
    old = -torch.rand(B, L, generator=gen, dtype=torch.float64)
    lp = (old + 0.1 * torch.randn(B, L, generator=gen, dtype=torch.float64)).requires_grad_(True)
    A = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, L)
    inp = PolicyLossInput(lp, old, A, mask)
    out = compute_policy_loss("gspo", inp, PolicyLossConfig(clip_ratio_low=0.9, clip_ratio_high=10.0))
    out.loss.backward()
    lengths = mask.sum(-1, keepdim=True)
    s = (((lp.detach() - old) * mask).sum(-1, keepdim=True) / lengths).exp()
    expected = -(1 / B) * s * A * mask / lengths
    torch.testing.assert_close(lp.grad, expected)


def test_gspo_clipped_sequence_has_zero_gradient():
    # s = e^{0.5} ≈ 1.65 > 1 + ε_hi with A > 0: the whole sequence is clipped
    lp = torch.full((1, 3), 0.5, dtype=torch.float64, requires_grad=True)
    inp = PolicyLossInput(lp, torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
                          torch.ones(1, 3))
    out = compute_policy_loss("gspo", inp, PolicyLossConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4))
    out.loss.backward()
    assert lp.grad.abs().max() == 0 and out.metrics["clipfrac"] == 1.0
    assert out.loss.item() == pytest.approx(-(1 + 4e-4))


# ---- SAPO -------------------------------------------------------------------------------

def test_sapo_on_policy_value_and_gradient():
    # r = 1: f = (4/τ)·σ(0) = 2/τ; ∂ℓ/∂lp = −A·4·σ(0)(1−σ(0))·1 = −A
    lp, inp, cfg = _tokens([1.0, 1.0], [1.0, -2.0])
    out = compute_policy_loss("sapo", inp, PolicyLossConfig(loss_agg_mode="token-sum"))
    out.loss.backward()
    # seq-mean-token-mean over one row of 2 tokens: (−(2/1)·1 − (2/1.05)·(−2)) / 2
    assert out.loss.item() == pytest.approx((-2.0 + 2 * 2 / 1.05) / 2)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 2.0]], dtype=torch.float64) / 2)


def test_sapo_gate_weight_at_ratio_two():
    # τ = 1, r = 2, A = 1: ∂ℓ/∂lp = −4σ(1)(1−σ(1))·r = −1.573
    lp, inp, _ = _tokens([2.0], [1.0])
    compute_policy_loss("sapo", inp, PolicyLossConfig(tau_pos=1.0)).loss.backward()
    sig = 1 / (1 + math.exp(-1))
    assert -lp.grad.item() == pytest.approx(4 * sig * (1 - sig) * 2)
    assert -lp.grad.item() == pytest.approx(1.573, abs=1e-3)


def test_sapo_tau_keeps_the_input_dtype():
    # float64, r = 1, A = −1 (τ = τ_neg = 1.05): ℓ = −(4/τ)·σ(0)·A = 2/1.05 exactly in float64;
    # a float32 τ (1.0499999523) gives 1.9047619912 instead of 1.9047619048
    _, inp, cfg = _tokens([1.0], [-1.0])
    assert compute_policy_loss("sapo", inp, cfg).loss.item() == 2 / 1.05


@pytest.mark.parametrize("seed", range(3))
def test_sapo_matches_reference(seed):
    inp = _random_input(seed)
    want = ref.agg(ref.elementwise(lambda lp, old, a: ref.sapo_token(lp, old, a, 1.0, 1.05),
                                   inp.logprobs.detach(), inp.old_logprobs, inp.advantages),
                   inp.response_mask, "seq-mean-token-mean")
    out = compute_policy_loss("sapo", inp, PolicyLossConfig())
    assert out.loss.item() == pytest.approx(want) and out.metrics["clipfrac"] == 0.0


# ---- CISPO and plain PG ----------------------------------------------------------------------

def test_cispo_gradient_is_clipped_weight_times_pg():
    # r = [2, 0.5, 1.1], ε = 0.2: weights clip(r, .8, 1.2) = [1.2, .8, 1.1]; ∂ℓ/∂lp = −w·A
    lp, inp, cfg = _tokens([2.0, 0.5, 1.1], [1.0, -1.0, 2.0])
    out = compute_policy_loss("cispo", inp, cfg)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.2, 0.8, -2.2]], dtype=torch.float64))
    assert out.metrics["clipfrac"] == pytest.approx(2 / 3)


def test_pg_is_minus_advantage_times_logprob():
    lp, inp, cfg = _tokens([0.5, 2.0], [1.0, -3.0])
    out = compute_policy_loss("pg", inp, cfg)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(math.log(0.5)) + 3 * math.log(2.0))
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 3.0]], dtype=torch.float64))
    assert POLICY_LOSSES.get("gpg") is POLICY_LOSSES.get("pg")


# ---- shared behaviour ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gmpo", "sapo", "cispo", "pg"])
def test_is_weights_multiply_the_token_loss(name):
    inp = _random_input(0)
    cfg = PolicyLossConfig(loss_agg_mode="token-sum")
    base = compute_policy_loss(name, inp, cfg).loss
    inp.is_weights = torch.full_like(inp.advantages, 0.5)
    torch.testing.assert_close(compute_policy_loss(name, inp, cfg).loss, 0.5 * base)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gmpo", "sapo", "cispo", "pg"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_full_batch(name, mode):
    inp = _random_input(1, B=6)
    cfg = PolicyLossConfig(loss_agg_mode=mode)
    full = compute_policy_loss(name, inp, cfg).loss
    tokens, seqs = global_counts(inp.response_mask)
    parts = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        micro = PolicyLossInput(inp.logprobs[rows], inp.old_logprobs[rows], inp.advantages[rows],
                                inp.response_mask[rows], global_tokens=tokens, global_seqs=seqs)
        parts.append(compute_policy_loss(name, micro, cfg).loss)
    torch.testing.assert_close(sum(parts), full)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_masked_tokens_get_no_gradient(name):
    inp = _random_input(2)
    compute_policy_loss(name, inp, PolicyLossConfig()).loss.backward()
    assert (inp.logprobs.grad[inp.response_mask == 0] == 0).all()
    assert {"clipfrac", "clipfrac_lower", "ppo_kl", "ratio_mean"} <= set(
        compute_policy_loss(name, inp, PolicyLossConfig()).metrics
    )


def test_config_validation():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="did you mean 'ppo_clip'"):
        compute_policy_loss("ppo-clip", _random_input(0), PolicyLossConfig())


def test_extreme_log_ratio_stays_finite():
    lp = torch.tensor([[60.0, -60.0]], requires_grad=True)
    inp = PolicyLossInput(lp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    for name in POLICY_LOSSES.names():
        out = compute_policy_loss(name, inp, PolicyLossConfig())
        assert math.isfinite(out.loss.item()), name


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_and_pg_match_reference_value_and_gradient(seed, mode):
    inp = _random_input(seed)
    lp, old, A, m = inp.logprobs.detach(), inp.old_logprobs, inp.advantages, inp.response_mask

    def cispo_token(lp_, old_, a):
        w = min(max(math.exp(lp_ - old_), 0.8), 1.28)
        return -w * a * lp_

    cases = {
        "cispo": (ref.elementwise(cispo_token, lp, old, A),
                  # ∂ℓ/∂lp = −w·A (the weight is detached)
                  ref.elementwise(lambda lp_, old_, a: -min(max(math.exp(lp_ - old_), 0.8), 1.28) * a, lp, old, A)),
        "pg": (ref.elementwise(lambda lp_, old_, a: -a * lp_, lp, old, A), -A.double()),
    }
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
    for name, (loss_mat, grad_mat) in cases.items():
        out = compute_policy_loss(name, inp, cfg)
        assert out.loss.item() == pytest.approx(ref.agg(loss_mat, m, mode)), name
        grad, = torch.autograd.grad(out.loss, inp.logprobs)
        # the aggregation is linear: its gradient is the per-token gradient times the
        # aggregation weight of that token, read off by aggregating a one-hot matrix
        expected = torch.zeros_like(grad)
        for i in range(m.shape[0]):
            for t in range(m.shape[1]):
                if m[i, t] > 0:
                    onehot = torch.zeros_like(m)
                    onehot[i, t] = 1.0
                    expected[i, t] = grad_mat[i, t] * ref.agg(onehot, m, mode)
        torch.testing.assert_close(grad, expected, msg=name)


# ---- GMPO -------------------------------------------------------------------------------------

def test_gmpo_by_hand():
    # one row, A = +1, log-ratios x = [0.1, 0.6], ε_hi = 0.4: A > 0 caps x at 0.4 -> [0.1, 0.4]
    # ρ = exp((0.1 + 0.4)/2) = e^{0.25}; loss = −1·e^{0.25}
    # gradient: token 0 (unclipped) −A·ρ/|o| = −e^{0.25}/2, token 1 (clipped) 0
    lp = torch.tensor([[0.1, 0.6]], dtype=torch.float64, requires_grad=True)
    inp = PolicyLossInput(lp, torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                          torch.ones(1, 2))
    out = compute_policy_loss("gmpo", inp, PolicyLossConfig(clip_ratio_low=0.4, clip_ratio_high=0.4))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-math.exp(0.25))
    torch.testing.assert_close(lp.grad, torch.tensor([[-math.exp(0.25) / 2, 0.0]], dtype=torch.float64))
    assert out.metrics["clipfrac"] == 0.5 and out.metrics["clipfrac_lower"] == 0.0
    assert POLICY_LOSSES.get("geo_mean") is POLICY_LOSSES.get("gmpo")


def test_gmpo_negative_advantage_floors_log_ratio():
    # A = −2, x = [−0.6, 0.2], ε_lo = 0.4: A < 0 floors x at −0.4 -> [−0.4, 0.2]
    # ρ = exp(−0.1); loss = −(−2)·ρ = 2e^{−0.1}
    lp = torch.tensor([[-0.6, 0.2]], dtype=torch.float64)
    inp = PolicyLossInput(lp, torch.zeros(1, 2, dtype=torch.float64), torch.full((1, 2), -2.0, dtype=torch.float64),
                          torch.ones(1, 2))
    out = compute_policy_loss("gmpo", inp, PolicyLossConfig(clip_ratio_low=0.4, clip_ratio_high=0.4))
    assert out.loss.item() == pytest.approx(2 * math.exp(-0.1)) and out.metrics["clipfrac_lower"] == 0.5


@pytest.mark.parametrize("seed", range(3))
def test_gmpo_matches_reference(seed):
    inp = _random_input(seed)
    lp, old, A, m = inp.logprobs.detach(), inp.old_logprobs, inp.advantages, inp.response_mask
    total, seqs = 0.0, 0
    for i in range(m.shape[0]):
        valid = [t for t in range(m.shape[1]) if m[i, t] > 0]
        if not valid:
            continue
        xs = []
        for t in valid:
            x, a = float(lp[i, t] - old[i, t]), float(A[i, t])
            xs.append(min(x, 0.4) if a > 0 else max(x, -0.4) if a < 0 else 0.0)
        a_bar = sum(float(A[i, t]) for t in valid) / len(valid)
        total += -a_bar * math.exp(sum(xs) / len(xs))
        seqs += 1
    out = compute_policy_loss("gmpo", inp, PolicyLossConfig(clip_ratio_low=0.4, clip_ratio_high=0.4))
    assert out.loss.item() == pytest.approx(total / seqs)
