"""The fused routing and align kernels (triton_moe_align.py) vs their torch references
(``moe.route_torch``, ``triton_moe.align_pairs``). On a GPU natively; on CPU with
``TRITON_INTERPRET=1`` (and triton installed) through the Triton interpreter; else skipped."""

import pytest
import torch
from conftest import skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from asyncrl.engine.models.moe import route_torch  # noqa: E402
from asyncrl.engine.triton_moe import align_pairs  # noqa: E402
from asyncrl.engine.triton_moe_align import fused_route, moe_align_block_size  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("T,E,K,renormalize", [(37, 8, 2, True), (5, 12, 3, False), (70, 128, 8, True)])
def test_fused_route_equals_transformers_router(T, E, K, renormalize):
    """Same experts in the same order, weights to fp32 rounding (another exp / summation order)."""
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).to(DEVICE) * 3
    w, ids = fused_route(logits, K, renormalize)
    w_ref, ids_ref = route_torch(logits, K, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == logits.dtype
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_fused_route_ties_keep_the_smallest_index():
    """bf16 logits tie often (8 mantissa bits). A value tied at the k-th place: the smallest index
    wins, as in torch.topk on CUDA (gatherTopK takes the ties in index order; torch's CPU topk does
    not promise it, so on CPU only the weights, equal for tied experts, are compared)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0],   # top-3: 3.0 (1, 3), then 2.0 -> 2
                           [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]],  # all tied: 0, 1, 2
                          dtype=torch.bfloat16, device=DEVICE)
    w, ids = fused_route(logits, 3, True)
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    rand = (torch.randn(300, 64, generator=torch.Generator().manual_seed(1)) * 2).to(DEVICE, torch.bfloat16)
    for x in (logits, rand):
        w, ids = fused_route(x, 3, True)
        w_ref, ids_ref = route_torch(x, 3, True)
        # 1 bf16 ulp: fp32 probabilities a few ulps apart can round to neighbouring bf16 values (and
        # the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest even)
        torch.testing.assert_close(w.sort(-1).values, w_ref.sort(-1).values, rtol=2**-7, atol=0)
        if CUDA:
            assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)


@pytest.mark.parametrize("T,K,E,block_m", [(3, 2, 4, 2), (37, 2, 8, 16), (256, 8, 128, 16), (700, 8, 16, 64),
                                           (1, 1, 5, 16), (1, 10, 512, 16), (3, 8, 256, 64),
                                           pytest.param(4200, 8, 128, 64, marks=pytest.mark.skipif(
                                               not CUDA, reason="prefill size: 33,600 pairs, 512-pair chunks; "
                                               "slow in the interpreter"))])
def test_align_equals_torch_reference(T, K, E, block_m):
    """Element for element: pairs by expert in ascending pair order, pads, block -> expert;
    700 x 8 pairs span several chunks (launch 2 adds the earlier chunks' counts); 512 experts at
    batch 1: 481 blocks in one program, written in tiles (Qwen3.5-MoE's expert counts)."""
    g = torch.Generator().manual_seed(T)
    skew = torch.rand(E, generator=g) ** 3  # some experts hot, some never hit
    ids = torch.multinomial(skew.expand(T, E), K, generator=g).to(DEVICE)
    pairs, block_expert = moe_align_block_size(ids, E, block_m)
    pairs_ref, block_expert_ref = align_pairs(ids, E, block_m)
    assert pairs.dtype == block_expert.dtype == torch.int32
    assert torch.equal(pairs, pairs_ref.to(torch.int32))
    assert torch.equal(block_expert, block_expert_ref.to(torch.int32))


def test_align_hand_example():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    pairs, block_expert = moe_align_block_size(ids, 4, block_m=2)
    # flat ids [2, 0, 2, 1, 0, 2]: expert 0 pairs 1, 4 | expert 1: pair 3 + pad (6) | expert 2: 0, 2, 5 + pad
    assert pairs.tolist()[:8] == [1, 4, 3, 6, 0, 2, 5, 6]
    assert block_expert.tolist()[:4] == [0, 1, 2, 2] and set(block_expert.tolist()[4:]) == {-1}


def test_fused_route_records_the_ids_at_their_slots():
    """Routing replay's record written by the routing kernel: ``buffer[slots, column] = ids`` as
    int16, other slots and layers untouched (the torch path does the same with an index_put)."""
    from asyncrl.engine.models.moe import route

    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    slots = torch.tensor([9, 3, 4, 0, 11, 7], device=DEVICE)
    buffer = torch.full((12, 3, 4), -7, dtype=torch.int16, device=DEVICE)
    _, ids = fused_route(logits, 4, True, (buffer, slots, 1))
    expected = torch.full((12, 3, 4), -7, dtype=torch.int16)
    expected[slots.cpu(), 1] = ids.cpu().to(torch.int16)
    assert torch.equal(buffer.cpu(), expected)
    torch_buffer = torch.full((12, 3, 4), -7, dtype=torch.int16)
    route(logits.cpu(), 4, True, (torch_buffer, slots.cpu(), 1))
    assert torch.equal(torch_buffer, expected)
