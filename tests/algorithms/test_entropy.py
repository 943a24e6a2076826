import math

import pytest
import torch

from asyncrl.algorithms import chunked_logprobs_and_entropy, entropy_from_logits, logprobs_from_logits

from . import reference as ref


def test_uniform_logits_give_log_vocab():
    # H(uniform over V) = log V
    assert entropy_from_logits(torch.zeros(2, 3, 50)).flatten().tolist() == pytest.approx([math.log(50)] * 6)


def test_one_hot_like_logits_give_zero_and_stay_finite():
    logits = torch.tensor([[1e4, 0.0, -1e4], [-1e30, 0.0, -1e30]])
    h = entropy_from_logits(logits)
    assert torch.isfinite(h).all() and h.abs().max() < 1e-6


def test_matches_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, generator=gen, dtype=torch.float64) * 5
    want = torch.tensor([ref.entropy(row.tolist()) for row in logits], dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(logits), want)


def test_shift_invariance_and_large_scale():
    # softmax ignores a constant shift; a naive −Σp·log p on exp(z) would overflow at 1e3
    z = torch.randn(3, 11, dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(z + 1e3), entropy_from_logits(z))


def test_logprobs_and_chunking():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 13, generator=gen)
    labels = torch.randint(0, 13, (10,), generator=gen)
    want = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), want)
    lp, ent = chunked_logprobs_and_entropy(logits.bfloat16(), labels, chunk_size=3)
    assert lp.dtype == torch.float32 and ent.shape == (10,)
    torch.testing.assert_close(lp, logprobs_from_logits(logits.bfloat16().float(), labels))
    torch.testing.assert_close(ent, entropy_from_logits(logits.bfloat16().float()))
    lp_only, none = chunked_logprobs_and_entropy(logits, labels, with_entropy=False)
    assert none is None and lp_only.shape == (10,)


def test_entropy_gradient_matches_autograd_of_reference_formula():
    z = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    g1, = torch.autograd.grad(entropy_from_logits(z).sum(), z)
    p = torch.softmax(z, -1)
    g2, = torch.autograd.grad((-(p * p.log()).sum(-1)).sum(), z)
    torch.testing.assert_close(g1, g2)


def test_chunked_gradients_match_unchunked():
    # checkpointed chunks must give the same gradients as one full computation
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (9,), generator=gen)
    w1, w2 = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    lp, ent = chunked_logprobs_and_entropy(logits, labels, chunk_size=4)
    g_chunked, = torch.autograd.grad((lp * w1 + ent * w2).sum(), logits)
    z = logits.float()
    full = (logprobs_from_logits(z, labels) * w1 + entropy_from_logits(z) * w2).sum()
    g_full, = torch.autograd.grad(full, logits)
    torch.testing.assert_close(g_chunked, g_full)


def test_chunked_empty_input():
    lp, ent = chunked_logprobs_and_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,)
