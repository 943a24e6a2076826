import math

import pytest
import torch

from asyncrl.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_penalty,
)

LP, REF = torch.tensor([-1.0]), torch.tensor([-2.0])  # x = lp − ref = 1


@pytest.mark.parametrize(
    "name, expected",
    [
        ("k1", 1.0), ("kl", 1.0),                 # x
        ("abs", 1.0),                             # |x|
        ("k2", 0.5), ("mse", 0.5),                # ½x²
        ("k3", math.exp(-1) + 1 - 1),             # d = −1: e^d − d − 1 = e^{−1} ≈ 0.3679
        ("low_var_kl", math.exp(-1)),
    ],
)
def test_hand_values(name, expected):
    assert kl_penalty(LP, REF, name).item() == pytest.approx(expected, rel=1e-6)


def test_k3_is_nonnegative_and_clamped():
    lp = torch.linspace(-30, 30, 61)
    k3 = kl_penalty(lp, torch.zeros_like(lp), "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all() and torch.isfinite(k3).all()


def test_k3_is_unbiased_for_kl():
    # E_π[k] summed exactly over a 3-token vocabulary equals KL(π‖π_ref) for k1 and k3
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    pref = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = (pi * (pi / pref).log()).sum()
    for name in ("k1", "k3"):
        est = (pi * kl_penalty(pi.log(), pref.log(), name)).sum()
        torch.testing.assert_close(est, true_kl)


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_straight_through_value_of_base_gradient_of_k2(base):
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    st_value = kl_penalty(lp, ref, base + "+")
    torch.testing.assert_close(st_value, kl_penalty(lp, ref, base))
    grad_st, = torch.autograd.grad(st_value.sum(), lp)
    grad_k2, = torch.autograd.grad(kl_penalty(lp, ref, "k2").sum(), lp)
    torch.testing.assert_close(grad_st, grad_k2)
    torch.testing.assert_close(grad_k2, (lp - ref).detach())  # ∂(½x²)/∂lp = x


def test_k3_plus_hand_gradient():
    # value k3 = e^{−1} ≈ 0.3679; gradient of k2 = x = 1
    lp = LP.clone().requires_grad_(True)
    out = kl_penalty(lp, REF, "k3+")
    out.backward()
    assert out.item() == pytest.approx(math.exp(-1), rel=1e-6) and lp.grad.item() == pytest.approx(1.0)


def test_registry_names_and_unknown():
    assert {"k1", "k2", "k3", "k3+", "low_var_kl+", "k1+"} <= set(KL_ESTIMATORS.names())
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LP, REF, "low_var")
    with pytest.raises(ValueError):
        kl_penalty(LP, REF, "full")


def test_fixed_controller_never_moves():
    ctl = build_kl_controller("fixed", kl_coef=0.01)
    ctl.update(current_kl=5.0, n_steps=1000)
    assert isinstance(ctl, FixedKLController) and ctl.value == 0.01


def test_adaptive_controller_by_hand():
    ctl = build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=1000)
    assert isinstance(ctl, AdaptiveKLController)
    # KL twice the target: e = clip(2 − 1, ±0.2) = 0.2; β = 0.1·(1 + 0.2·100/1000) = 0.102
    ctl.update(current_kl=0.2, n_steps=100)
    assert ctl.value == pytest.approx(0.102)
    # KL half the target: e = −0.5 -> −0.2; β = 0.102·(1 − 0.02) = 0.09996
    ctl.update(current_kl=0.05, n_steps=100)
    assert ctl.value == pytest.approx(0.09996)
    # on target: unchanged
    ctl.update(current_kl=0.1, n_steps=100)
    assert ctl.value == pytest.approx(0.09996)


def test_unknown_controller():
    with pytest.raises(ValueError, match="adaptive"):
        build_kl_controller("pid")


def test_kl_in_reward_by_hand():
    # row 0: 2 valid tokens, k1 = lp_old − lp_ref = [1, 0.5]; score 1 on token 1, β = 0.1
    #   rewards = [0 − 0.1·1, 1 − 0.1·0.5] = [−0.1, 0.95]; token-mean KL = 0.75
    # row 1: 1 valid token, k1 = 0.25; score 0 -> [−0.025, 0]; token-mean KL = 0.25
    # current_kl = mean(0.75, 0.25) = 0.5
    from asyncrl.algorithms import kl_in_reward

    old = torch.tensor([[1.0, 0.5], [0.25, 9.0]])
    ref = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    token_rewards, current_kl = kl_in_reward(torch.tensor([1.0, 0.0]), mask, old, ref, kl_coef=0.1)
    torch.testing.assert_close(token_rewards, torch.tensor([[-0.1, 0.95], [-0.025, 0.0]]))
    assert current_kl == pytest.approx(0.5)


def test_estimators_match_elementwise_reference():
    gen = torch.Generator().manual_seed(5)
    lp = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 4
    ref_lp = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 4

    def k3(x):
        d = min(max(-x, -20.0), 20.0)
        return min(max(math.exp(d) - d - 1, -10.0), 10.0)

    formulas = {"k1": lambda x: x, "abs": abs, "k2": lambda x: 0.5 * x * x, "k3": k3}
    for name, f in formulas.items():
        want = torch.tensor([[f(float(a - b)) for a, b in zip(r1, r2)] for r1, r2 in zip(lp, ref_lp)],
                            dtype=torch.float64)
        torch.testing.assert_close(kl_penalty(lp, ref_lp, name), want, msg=name)
