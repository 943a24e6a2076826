import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algorithms import ADV_ESTIMATORS, AdvantageInput, compute_advantages

from . import reference as ref
from .helpers import random_groups, random_mask


def _inp(scores, L=3, group_ids=None, **kw):
    scores = torch.tensor(scores, dtype=torch.float64)
    B = scores.shape[0]
    gids = torch.zeros(B, dtype=torch.long) if group_ids is None else torch.tensor(group_ids)
    return AdvantageInput(scores=scores, response_mask=torch.ones(B, L, dtype=torch.float64), group_ids=gids, **kw)


# ---- hand-derived values (ALGORITHMS.md §11) ------------------------------------------

def test_grpo_one_correct_of_four():
    # μ = 0.25; unbiased σ = sqrt((0.75² + 3·0.25²)/3) = sqrt(0.75/3) = 0.5
    # A = (1 − .25)/.5 = 1.5, (0 − .25)/.5 = −0.5   (a biased std would give 1.732)
    adv = compute_advantages("grpo", _inp([1.0, 0, 0, 0])).advantages
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64)
    torch.testing.assert_close(adv, expected.unsqueeze(-1).expand(4, 3), atol=1e-5, rtol=0)


def test_grpo_equal_rewards_zero_and_singleton_raw():
    # all equal: numerator 0 -> A = 0 (no NaN thanks to ε)
    assert compute_advantages("grpo", _inp([1.0, 1, 1, 1])).advantages.abs().max() == 0
    # singleton group: no baseline, A = R exactly
    adv = compute_advantages("grpo", _inp([0.7, 2.0], group_ids=[0, 1])).advantages
    assert adv[:, 0].tolist() == [0.7, 2.0]


def test_dr_grpo_is_grpo_without_std():
    # Dr. GRPO: A = R − μ = [0.75, −0.25, −0.25, −0.25]
    out = compute_advantages("grpo", _inp([1.0, 0, 0, 0], norm_adv_by_std_in_grpo=False))
    assert out.advantages[:, 0].tolist() == [0.75, -0.25, -0.25, -0.25]


def test_rloo_one_correct_of_four():
    # A_0 = 1 − mean(0,0,0) = 1;  A_1 = 0 − mean(1,0,0) = −1/3
    adv = compute_advantages("rloo", _inp([1.0, 0, 0, 0])).advantages[:, 0]
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=torch.float64))


def test_rloo_singleton_keeps_raw_reward():
    adv = compute_advantages("rloo", _inp([0.5], group_ids=[9])).advantages
    assert adv.tolist() == [[0.5, 0.5, 0.5]]


def test_remax_subtracts_greedy_baseline():
    # reward 1 on the last token, γ = 1: G = [1, 1, 1]; baseline 0.25 -> A = 0.75 everywhere
    out = compute_advantages("remax", _inp([1.0], baseline_scores=torch.tensor([0.25], dtype=torch.float64)))
    assert out.advantages.tolist() == [[0.75, 0.75, 0.75]]
    assert out.returns.tolist() == [[1.0, 1.0, 1.0]]


def test_gae_single_row_by_hand():
    # r = [0, 0, 1], V = [0.5, 0.5, 0.5], γ = λ = 1:
    # δ_2 = 1 − .5 = .5;  δ_1 = 0 + .5 − .5 = 0;  δ_0 = 0
    # Â = [.5, .5, .5], returns = Â + V = [1, 1, 1]; whitening a constant gives 0
    values = torch.full((1, 3), 0.5, dtype=torch.float64)
    out = compute_advantages("gae", _inp([1.0], values=values))
    assert out.returns.tolist() == [[1.0, 1.0, 1.0]]
    assert out.advantages.abs().max() == 0


def test_gae_discounting_by_hand():
    # r = [0, 1] (reward on the last token), V = 0, γ = 0.5, λ = 1:
    # Â_1 = 1;  Â_0 = 0 + .5·0 − 0 + .5·1·1 = 0.5;  returns = [0.5, 1]
    out = compute_advantages("gae", _inp([1.0], L=2, values=torch.zeros(1, 2, dtype=torch.float64), gamma=0.5))
    assert out.returns.tolist() == [[0.5, 1.0]]


def test_opo_length_weighted_baseline():
    # lengths 1 and 3, R = 1 and 0: b = (1·1 + 3·0)/4 = 0.25 -> A = [0.75, −0.25]
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]], dtype=torch.float64)
    inp = AdvantageInput(torch.tensor([1.0, 0.0], dtype=torch.float64), mask, torch.zeros(2, dtype=torch.long))
    adv = compute_advantages("opo", inp).advantages
    assert adv.tolist() == [[0.75, 0, 0], [-0.25, -0.25, -0.25]]


def test_opo_one_sample_group_keeps_raw_reward():
    # group 0: one response, R = 0.7 -> no baseline (verl: b = 0), A = 0.7 (was 0: b = R itself)
    # group 1: lengths 1, 3 and R = 1, 0 -> b = 0.25, A = [0.75, −0.25] as above
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    inp = AdvantageInput(torch.tensor([0.7, 1.0, 0.0], dtype=torch.float64), mask, torch.tensor([0, 1, 1]))
    adv = compute_advantages("opo", inp).advantages
    assert adv.tolist() == [[0.7, 0.7, 0], [0.75, 0, 0], [-0.25, -0.25, -0.25]]


def test_gpg_scales_by_nonzero_fraction():
    # B = 4, one non-zero reward -> α = 4; μ = .25 -> A = 4·[.75, −.25, ...] = [3, −1, −1, −1]
    adv = compute_advantages("gpg", _inp([1.0, 0, 0, 0])).advantages[:, 0]
    assert adv.tolist() == [3.0, -1.0, -1.0, -1.0]


def test_grpo_passk_credits_only_the_best():
    # [1,0,0,0]: R_max − R_second = 1 − 0 = 1, ÷ (σ = 0.5) -> 2 for row 0, 0 elsewhere
    adv = compute_advantages("grpo_passk", _inp([1.0, 0, 0, 0])).advantages[:, 0]
    torch.testing.assert_close(adv, torch.tensor([2.0, 0, 0, 0], dtype=torch.float64), atol=1e-5, rtol=0)
    # two groups, no std normalisation: best of [.2,.9,.5] gets .9 − .5 = .4; tie [1, 1] gets 0
    out = compute_advantages("grpo_passk", _inp([0.2, 0.9, 0.5, 1.0, 1.0], group_ids=[3, 3, 3, 8, 8],
                                                 norm_adv_by_std_in_grpo=False)).advantages[:, 0]
    torch.testing.assert_close(out, torch.tensor([0, 0.4, 0, 0, 0], dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages("grpo_passk", _inp([1.0], group_ids=[0]))


# ---- conventions ------------------------------------------------------------------------

def test_default_token_rewards_put_score_on_last_valid_token():
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 0, 1, 0]])
    inp = AdvantageInput(torch.tensor([2.0, 3.0]), mask, torch.tensor([0, 1]))
    assert inp.rewards().tolist() == [[0, 2, 0, 0], [0, 0, 3, 0]]


def test_token_rewards_define_the_outcome():
    # KL-in-reward: R_i = Σ_t token_rewards·mask, not scores
    mask = torch.ones(2, 2)
    token_rewards = torch.tensor([[-0.1, 1.0], [-0.1, 0.0]])
    inp = AdvantageInput(torch.tensor([5.0, 5.0]), mask, torch.zeros(2, dtype=torch.long), token_rewards=token_rewards)
    adv = compute_advantages("grpo", inp).advantages  # R = [0.9, −0.1]: σ = √0.5
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5 / 0.5**0.5, -0.5 / 0.5**0.5]), atol=1e-5, rtol=0)


def test_unknown_estimator_suggests_closest():
    with pytest.raises(ValueError, match="did you mean 'grpo'"):
        compute_advantages("grp", _inp([1.0]))


def test_shape_mismatch_is_reported():
    inp = _inp([1.0, 0.0])
    inp.group_ids = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", inp)


def test_missing_inputs_are_reported():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", _inp([1.0]))
    with pytest.raises(ValueError, match="baseline_scores"):
        compute_advantages("remax", _inp([1.0]))


# ---- against float64 loop references on random inputs ---------------------------------

def _random_case(seed, B=12, L=7):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(B, L, gen)
    gids = random_groups(B, gen)
    scores = torch.randint(0, 3, (B,), generator=gen).double() - 0.5 * torch.rand(B, generator=gen).double()
    token_rewards = torch.randn(B, L, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(B, L, generator=gen, dtype=torch.float64)
    baseline = torch.randn(B, generator=gen, dtype=torch.float64)
    return AdvantageInput(scores, mask, gids, token_rewards=token_rewards, values=values,
                          baseline_scores=baseline, gamma=0.9, lam=0.8)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("use_token_rewards", [False, True])
def test_outcome_estimators_match_reference(seed, use_token_rewards):
    inp = _random_case(seed)
    if not use_token_rewards:
        inp.token_rewards = None
    m, g = inp.response_mask, inp.group_ids
    R = ref.outcome(inp.scores, m, inp.token_rewards)
    expected = {
        "grpo": ref.grpo(R, g, m),
        "rloo": ref.rloo(R, g, m),
        "reinforce_plus_plus_baseline": ref.rpp_baseline(R, g, m),
        "opo": ref.opo(R, g, m),
        "gpg": ref.gpg(R, g, m),
    }
    for name, want in expected.items():
        got = compute_advantages(name, inp).advantages
        torch.testing.assert_close(got, want, msg=name)
    dr = compute_advantages("grpo", AdvantageInput(**{**inp.__dict__, "norm_adv_by_std_in_grpo": False}))
    torch.testing.assert_close(dr.advantages, ref.grpo(R, g, m, norm=False))


@pytest.mark.parametrize("seed", range(5))
def test_token_estimators_match_reference(seed):
    inp = _random_case(seed)
    m, rewards = inp.response_mask, inp.token_rewards
    G = ref.reward_to_go(rewards, m, inp.gamma)

    out = compute_advantages("reinforce_plus_plus", inp)
    torch.testing.assert_close(out.returns, G)
    torch.testing.assert_close(out.advantages, ref.whiten(G, m))

    out = compute_advantages("remax", inp)
    torch.testing.assert_close(out.advantages, (G - inp.baseline_scores.unsqueeze(-1)) * m)

    out = compute_advantages("gae", inp)
    want_adv, want_ret = ref.gae(rewards, inp.values, m, inp.gamma, inp.lam)
    torch.testing.assert_close(out.advantages, want_adv)
    torch.testing.assert_close(out.returns, want_ret)


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_advantages_zero_on_masked_tokens_and_no_grad(name):
    inp = _random_case(0)
    if name == "grpo_passk":  # needs groups of ≥ 2
        inp.group_ids = torch.arange(inp.scores.shape[0]) // 2
    inp.scores.requires_grad_(True)
    out = compute_advantages(name, inp)
    assert not out.advantages.requires_grad
    assert out.advantages.shape == inp.response_mask.shape
    assert (out.advantages[inp.response_mask == 0] == 0).all()
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns).all()


def test_float32_input_gives_float32_output():
    inp = AdvantageInput(torch.tensor([1.0, 0.0]), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, dtype=torch.long))
    assert compute_advantages("grpo", inp).advantages.dtype == torch.float32


# ---- properties ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(
    value=st.floats(-10, 10, allow_nan=False),
    sizes=st.lists(st.integers(1, 16), min_size=1, max_size=5),
    name=st.sampled_from(["grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_equal_rewards_in_a_group_give_exactly_zero_advantage(value, sizes, name, dtype):
    # Groups of size > 1 with a constant reward must get exactly 0, not an ulp of the mean
    # divided by (σ ≈ 0) + ε. Singletons keep their raw reward by convention, so they are
    # only checked to be untouched by the others (rpp_baseline whitening mixes rows, so
    # there every group must be non-singleton).
    gids = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])
    scores = torch.full((len(gids),), value, dtype=dtype)
    inp = AdvantageInput(scores, torch.ones(len(gids), 4, dtype=dtype), gids)
    adv = compute_advantages(name, inp).advantages
    in_group = torch.tensor([sizes[g] > 1 for g in gids.tolist()])
    if name == "reinforce_plus_plus_baseline" and not bool(in_group.all()):
        return
    assert (adv[in_group] == 0).all()


def test_constant_float32_group_regression():
    # 0.7 sixteen times: a plain Σ/16 in float32 misses 0.7 by an ulp, and dividing that
    # by (σ ≈ 0) + 1e-6 gave every response of an all-correct group |A| ≈ 0.056
    inp = AdvantageInput(torch.full((16,), 0.7), torch.ones(16, 2), torch.zeros(16, dtype=torch.long))
    assert (compute_advantages("grpo", inp).advantages == 0).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=8), st.floats(-3, 3), st.floats(0.1, 4))
def test_grpo_is_invariant_to_affine_reward_change(rewards, shift, scale):
    # (aR + b − (aμ + b)) / (aσ) = (R − μ)/σ, up to ε
    scores = torch.tensor(rewards, dtype=torch.float64)
    if scores.std() < 1e-2:
        return
    def adv(s):
        return compute_advantages("grpo", _inp(s.tolist(), L=1, group_ids=[0] * len(rewards), epsilon=0.0)).advantages
    torch.testing.assert_close(adv(scores), adv(scale * scores + shift))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=8))
def test_rloo_is_scaled_dr_grpo(rewards):
    # R_i − mean_{j≠i} R_j = n/(n−1)·(R_i − μ)
    n = len(rewards)
    inp = _inp(rewards, L=1, group_ids=[0] * n, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(
        compute_advantages("rloo", inp).advantages, n / (n - 1) * compute_advantages("grpo", inp).advantages
    )


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg"])
def test_integer_scores_and_empty_rows(name):
    # 0/1 accuracy as a long tensor; row 2 has no valid token (e.g. an aborted response)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    inp = AdvantageInput(torch.tensor([1, 0, 1, 0]), mask, torch.tensor([0, 0, 0, 0]))
    adv = compute_advantages(name, inp).advantages
    assert adv.dtype == torch.get_default_dtype() and torch.isfinite(adv).all()
    assert (adv[2] == 0).all() and (adv[~mask] == 0).all()


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "gae"])
def test_constant_token_returns_whiten_to_exactly_zero(name):
    # every valid token has the same return (float32): the whitened advantage must be 0,
    # not an ulp of the mean amplified by rsqrt(0 + 1e-8) = 1e4
    mask = torch.ones(16, 1)
    inp = AdvantageInput(torch.full((16,), 0.7), mask, torch.zeros(16, dtype=torch.long),
                         values=torch.zeros(16, 1))
    assert (compute_advantages(name, inp).advantages == 0).all()


def test_whiten_empty_mask_is_finite():
    from asyncrl.algorithms import masked_whiten

    out = masked_whiten(torch.randn(2, 3), torch.zeros(2, 3))
    assert torch.isfinite(out).all()


def test_undiscounted_fast_path_matches_loop_reference():
    # γ = 1 takes the cumsum path; compare with the loop reference on masks with holes
    inp = _random_case(11)
    inp.gamma = 1.0
    out = compute_advantages("reinforce_plus_plus", inp)
    torch.testing.assert_close(out.returns, ref.reward_to_go(inp.token_rewards, inp.response_mask, 1.0))


@pytest.mark.parametrize("seed", range(3))
def test_grpo_passk_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    B, L = 12, 4
    gids = torch.arange(B) // 3  # groups of 3
    scores = torch.rand(B, generator=gen, dtype=torch.float64)
    mask = random_mask(B, L, gen)
    want = [0.0] * B
    for idx in ref.groups_of(gids).values():
        order = sorted(idx, key=lambda i: -float(scores[i]))
        best, second = order[0], order[1]
        rs = [float(scores[i]) for i in idx]
        want[best] = (rs[idx.index(best)] - float(scores[second])) / (ref.std_unbiased(rs) + 1e-6)
    got = compute_advantages("grpo_passk", AdvantageInput(scores, mask, gids)).advantages
    torch.testing.assert_close(got, ref.broadcast(want, mask))
