"""spec/verifier.py: speculative sampling draws exactly the target's distribution.

The target is a Markov chain over 12 tokens (logits depend on the previous token only), so
the exact distribution of the first three generated tokens is known in closed form.
8,192 samples are generated speculatively (k = 3 drafts per round, rounds until three tokens) and
compared with it by total-variation distance. The bound is 4x the expected TV of an exact
sampler at this sample size (sum over categories of sqrt(2 p (1 - p) / (pi N)) / 2): loose
enough never to fail an exact sampler with these fixed seeds, tight enough that a wrong rule
(the negative controls) fails it.
"""
import math

import pytest
import torch

from asyncrl.engine.sampler import processed_logprobs, row_keys
from asyncrl.engine.spec.verifier import acceptance_uniform, verify

V, N, K, STEPS = 12, 8192, 3, 3
g = torch.Generator().manual_seed(0)
TARGET = torch.randn(V, V, generator=g) * 1.5          # logits of the next token given the previous
DRAFT = (TARGET + torch.randn(V, V, generator=g)).softmax(-1)  # a related draft distribution ...
DRAFT[:, :2] = 0                                        # ... with zeros where p > 0
DRAFT = DRAFT / DRAFT.sum(-1, keepdim=True)

SETTINGS = {  # (temperature, top_k, top_p)
    "temperature": (0.7, -1, 1.0),
    "top_k": (1.3, 5, 1.0),
    "top_p": (1.0, -1, 0.8),
    "all": (0.8, 6, 0.9),
}


def _p(t, k, p):
    """The processed target distribution per previous token ``[V, V]`` (fp64 for the exact law)."""
    n = TARGET.shape[0]
    lp = processed_logprobs(TARGET, torch.full((n,), t), torch.full((n,), k), torch.full((n,), p), True)
    return lp.double().exp()


def exact_law(t, k, p, start: int) -> torch.Tensor:
    """P(t1, t2, t3) ``[V, V, V]`` from ``start``."""
    P = _p(t, k, p)
    return torch.einsum("a,ab,bc->abc", P[start], P, P)


def generate(t, k, p, start: int, drafts: str, rule=verify) -> torch.Tensor:
    """``[N, STEPS]`` tokens generated speculatively from ``start``; drafts "sampled" (from the
    draft chain, with its probs), "argmax" (deterministic, one-hot) or "fixed" (a constant
    guess, one-hot: the n-gram case of a bad match)."""
    gen = torch.Generator().manual_seed(1)
    out = torch.full((N, STEPS + K + 1), -1, dtype=torch.int64)
    count = torch.zeros(N, dtype=torch.int64)
    last = torch.full((N,), start, dtype=torch.int64)
    seeds = torch.arange(N, dtype=torch.int64) + 12345
    temp, topk, topp = torch.full((N,), t), torch.full((N,), k), torch.full((N,), p)
    while (count < STEPS).any():
        ids, qs, prev = [], [], last
        for _ in range(K):
            q = DRAFT[prev]
            if drafts == "sampled":
                x = torch.multinomial(q, 1, generator=gen).squeeze(1)
            elif drafts == "argmax":
                x = q.argmax(-1)
            else:
                x = torch.full_like(prev, 7)
            ids.append(x)
            qs.append(q)
            prev = x
        draft_ids = torch.stack(ids, 1)
        context = torch.cat([last[:, None], draft_ids], 1)     # row j's logits come from token j
        logits = TARGET[context]                                 # [N, K+1, V]
        pos = count[:, None] + torch.arange(K + 1)[None, :]      # position of the token drawn
        keys = row_keys(seeds[:, None], torch.zeros(N, 1, dtype=torch.int64), pos)
        res = rule(logits, draft_ids, torch.full((N,), K), temp, topk, topp, keys,
                   draft_probs=torch.stack(qs, 1) if drafts == "sampled" else None)
        for i in range(K + 1):
            take = (i < res.num_emitted) & (count < STEPS)
            out[take, count[take]] = res.tokens[take, i]
            count = count + take.long()
        last = out[torch.arange(N), count - 1]
    return out[:, :STEPS]


def tv(samples: torch.Tensor, law: torch.Tensor) -> tuple[float, float]:
    """(TV distance of the samples' empirical law to ``law``, the bound for N samples)."""
    idx = (samples * torch.tensor([V * V, V, 1])).sum(1)
    emp = torch.bincount(idx, minlength=V ** 3).double() / len(samples)
    flat = law.reshape(-1)
    expected = 0.5 * (2 * flat * (1 - flat) / (math.pi * len(samples))).sqrt().sum().item()
    return 0.5 * (emp - flat).abs().sum().item(), 4 * expected


CASES = [(s, "sampled") for s in sorted(SETTINGS)] + [("all", "argmax"), ("all", "fixed")]


@pytest.mark.parametrize("setting,drafts", CASES)
def test_speculative_tokens_follow_the_target_law(setting, drafts):
    t, k, p = SETTINGS[setting]
    dist, bound = tv(generate(t, k, p, 3, drafts), exact_law(t, k, p, 3))
    assert dist < bound, f"TV {dist:.4f} >= {bound:.4f}"


def test_greedy_emits_the_argmax_chain():
    out = generate(0.0, -1, 1.0, 3, "sampled")
    chain = [3]
    for _ in range(STEPS):
        chain.append(int(TARGET[chain[-1]].argmax()))
    assert (out == torch.tensor(chain[1:])).all()


def _accept_if_q_likes_it(logits, draft_ids, num_drafts, temp, top_k, top_p, keys, draft_probs=None):
    """A WRONG rule (negative control): accepts with probability q(x), not min(1, p/q)."""
    from asyncrl.engine.spec.verifier import VerifyResult

    res = verify(logits, draft_ids, num_drafts, temp, top_k, top_p, keys)
    qx = draft_probs.gather(2, draft_ids[..., None]).squeeze(2)
    ok = (acceptance_uniform(keys[:, :-1]) < qx).long().cumprod(1).sum(1)
    tokens = torch.cat([draft_ids, res.tokens[:, -1:]], 1)
    tokens = torch.where(torch.arange(K + 1)[None, :] < ok[:, None], tokens, res.tokens)
    return VerifyResult(tokens, res.logprobs, ok + 1)


def test_the_bound_catches_a_wrong_rule():
    t, k, p = SETTINGS["all"]
    dist, bound = tv(generate(t, k, p, 3, "sampled", rule=_accept_if_q_likes_it), exact_law(t, k, p, 3))
    assert dist > bound


@pytest.mark.parametrize("drafts", [None, "sampled"])
def test_emitted_logprobs_are_the_targets_processed_ones(drafts):
    """Every emitted token carries log p_target(token) at its position (never q)."""
    t, k, p = SETTINGS["all"]
    n = 512
    draft_ids = torch.randint(0, V, (n, K), generator=torch.Generator().manual_seed(3))
    logits = TARGET[torch.cat([torch.full((n, 1), 3), draft_ids], 1)]
    q = DRAFT[torch.cat([torch.full((n, 1), 3), draft_ids[:, :-1]], 1)] if drafts else None
    keys = row_keys(torch.arange(n)[:, None], torch.zeros(n, 1, dtype=torch.int64), torch.arange(K + 1)[None, :])
    res = verify(logits, draft_ids, torch.full((n,), K), torch.full((n,), t), torch.full((n,), k),
                 torch.full((n,), p), keys, draft_probs=q)
    P = processed_logprobs(logits.reshape(-1, V), torch.full((n * (K + 1),), t), torch.full((n * (K + 1),), k),
                           torch.full((n * (K + 1),), p), True).view(n, K + 1, V)
    expect = P.gather(2, res.tokens[..., None]).squeeze(2)
    emitted = torch.arange(K + 1)[None, :] < res.num_emitted[:, None]
    assert torch.isfinite(res.logprobs[emitted]).all()  # an emitted token is in the target's support
    torch.testing.assert_close(res.logprobs[emitted], expect[emitted])
    assert (res.num_emitted >= 1).all() and (res.num_emitted <= K + 1).all()


def test_num_drafts_caps_acceptance():
    """Drafts past a row's count are never accepted: the bonus comes right after them."""
    n = 64
    logits = torch.zeros(n, K + 1, V)
    logits[..., 4] = 50.0  # the target always says 4
    draft_ids = torch.full((n, K), 4)
    counts = torch.arange(n) % (K + 1)
    keys = torch.zeros(n, K + 1, dtype=torch.int64)
    res = verify(logits, draft_ids, counts, torch.ones(n), torch.full((n,), -1), torch.ones(n), keys)
    assert (res.num_emitted == counts + 1).all()
