import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algorithms import LOSS_AGG_MODES, agg_loss, global_counts

from . import reference as ref

# two sequences with lengths 1 and 3, padded to L = 4, every ℓ = 1
LOSS = torch.ones(2, 4)
MASK = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 1.0),               # (1 + 3) / 4 tokens
        ("seq-mean-token-mean", 1.0),      # (1/1 + 3/3) / 2 seqs
        ("seq-mean-token-sum", 2.0),       # (1 + 3) / 2 seqs
        ("seq-mean-token-sum-norm", 0.5),  # (1 + 3) / 2 seqs / L=4
        ("token-sum", 4.0),                # 1 + 3
    ],
)
def test_hand_values(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_norm_length_overrides_padded_length():
    # Dr. GRPO with a generation budget of 8: (1 + 3) / 2 / 8
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=8).item() == pytest.approx(0.25)


def test_fully_masked_rows_do_not_count_as_sequences():
    mask = torch.cat([MASK, torch.zeros(1, 4)])
    loss = torch.ones(3, 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(2.0)
    assert global_counts(mask) == (4.0, 2.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_gives_zero_not_nan(mode):
    out = agg_loss(torch.ones(2, 3), torch.zeros(2, 3), mode)
    assert out.item() == 0.0


def test_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, MASK, "mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_matches_reference(mode):
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=gen) < 0.6).double()
    mask[2] = 0  # an empty row
    assert agg_loss(loss, mask, mode).item() == pytest.approx(ref.agg(loss, mask, mode))


@st.composite
def batches(draw, equal_lengths=False):
    B = draw(st.integers(1, 6))
    L = draw(st.integers(1, 6))
    if equal_lengths:
        n = draw(st.integers(1, L))
        lengths = [n] * B
    else:
        lengths = draw(st.lists(st.integers(0, L), min_size=B, max_size=B))
    mask = (torch.arange(L).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).double()
    values = draw(st.lists(st.floats(-100, 100, allow_nan=False), min_size=B * L, max_size=B * L))
    return torch.tensor(values, dtype=torch.float64).view(B, L), mask


@settings(max_examples=60, deadline=None)
@given(batches(equal_lengths=True))
def test_equal_lengths_token_mean_equals_seq_mean_token_mean(batch):
    loss, mask = batch
    a = agg_loss(loss, mask, "token-mean")
    b = agg_loss(loss, mask, "seq-mean-token-mean")
    torch.testing.assert_close(a, b)
    # and seq-mean-token-sum-norm with L_norm = the common length equals both
    n = float(mask[0].sum())
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=n), a)


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from(LOSS_AGG_MODES), st.data())
def test_micro_batches_with_global_counts_sum_to_full_batch(batch, mode, data):
    loss, mask = batch
    B = loss.shape[0]
    cuts = sorted(data.draw(st.lists(st.integers(1, B - 1), max_size=3, unique=True)) if B > 1 else [])
    tokens, seqs = global_counts(mask)
    full = agg_loss(loss, mask, mode)
    parts = [
        agg_loss(loss[a:b], mask[a:b], mode, global_tokens=tokens, global_seqs=seqs)
        for a, b in zip([0, *cuts], [*cuts, B])
    ]
    torch.testing.assert_close(sum(parts), full)


def test_micro_batch_gradients_accumulate_to_full_batch_gradient():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    for mode in LOSS_AGG_MODES:
        full_grad, = torch.autograd.grad(agg_loss(theta**2, mask, mode), theta)
        tokens, seqs = global_counts(mask)
        for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
            agg_loss(theta[rows] ** 2, mask[rows], mode, global_tokens=tokens, global_seqs=seqs).backward()
        torch.testing.assert_close(theta.grad, full_grad, msg=mode)
        theta.grad = None
