"""The varlen key gather's atomic-free backward (varlen_gather.py) equals index_select's autograd."""
import pytest
import torch

from asyncrl.training.varlen import varlen_rows, varlen_rows_of_groups
from asyncrl.training.varlen_gather import gather_key_slots, scatter_slots


def _layout(pad_multiple=1):
    """Three groups: rows of unequal lengths, an empty response, a group whose only row has no inputs."""
    return varlen_rows_of_groups([([1, 2, 3], [[4, 5, 6], [], [7, 7], [8, 9]]),
                                  ([10, 11], [[12]]),  # one response token: no inputs, the prompt has one slot
                                  ([13], [[14, 15, 16, 17], [18, 19]])], pad_multiple)


@pytest.mark.parametrize("pad_multiple", [1, 16])
def test_slot_map_lists_every_slot_once(pad_multiple):
    rows = _layout(pad_multiple)
    s, key = rows.slots, rows.key_index
    listed = torch.cat([s.first_slot, s.extra_slots[s.extra_slots >= 0]])
    assert sorted(listed.tolist()) == list(range(key.numel()))
    assert torch.equal(key[s.first_slot], torch.arange(rows.tokens))
    owners = s.extra_tokens[:, None].expand_as(s.extra_slots)
    assert torch.equal(key[s.extra_slots[s.extra_slots >= 0]], owners[s.extra_slots >= 0])
    # group 0's prompt tokens: 3 more slots (rows 0, 2, 3; row 1 is empty); group 2's token: 2; group 1's
    # only row has one response token, so no inputs: its prompt tokens have no more slots
    assert sorted(len([x for x in r if x >= 0]) for r in s.extra_slots.tolist()) == [2, 3, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pad_multiple", [1, 16])
def test_backward_equals_index_select(dtype, pad_multiple):
    rows = _layout(pad_multiple)
    g = torch.Generator().manual_seed(pad_multiple)
    x = torch.randn(rows.tokens, 2, 4, generator=g, dtype=dtype)
    upstream = torch.randn(rows.key_index.numel(), 2, 4, generator=g, dtype=dtype)
    grads = []
    for slots in (rows.slots, None):
        leaf = x.clone().requires_grad_()
        out = gather_key_slots(leaf, rows.key_index, slots)
        assert torch.equal(out, x[rows.key_index])
        (out * upstream).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-6)


def test_bf16_sums_in_fp32_and_rounds_once():
    """A prompt token with 4 slots of bf16 gradients: the sum is the fp32 sum rounded once."""
    rows = _layout()
    grad = torch.full((rows.key_index.numel(), 1), 1.0 + 2 ** -7, dtype=torch.bfloat16)
    out = scatter_slots(grad, rows.slots)
    token = rows.slots.extra_tokens[0]
    slots = (rows.key_index == token).sum().item()
    assert out[token].item() == torch.tensor(slots * (1.0 + 2 ** -7)).bfloat16().item()


def test_varlen_rows_carry_the_slot_map():
    ids = torch.tensor([[0, 11, 12, 5, 6, 7], [0, 11, 12, 8, 9, 0], [13, 14, 15, 9, 10, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]])
    rows = varlen_rows(ids, attn, 3)
    # tokens 11 12 | 5 6 | 8 | 13 14 15 | 9; slots: prompt 0 (0 1), row 0 (0 1 2 3), row 1 (0 1 4),
    # prompt 1 (5 6 7), row 2 (5 6 7 8)
    assert rows.key_index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 5, 6, 7, 8]
    assert rows.slots.first_slot.tolist() == [0, 1, 4, 5, 8, 9, 10, 11, 15]
    assert rows.slots.extra_tokens.tolist() == [0, 1, 5, 6, 7]
    assert rows.slots.extra_slots.tolist() == [[2, 6], [3, 7], [12, -1], [13, -1], [14, -1]]
