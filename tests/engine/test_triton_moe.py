"""The Triton fused-MoE grouped GEMM and GDN decode kernels vs their torch references.

On a GPU they run natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) the same
checks run through the Triton interpreter; otherwise the module is skipped.
"""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA: run with TRITON_INTERPRET=1 to use the Triton interpreter", allow_module_level=True)
pytest.importorskip("triton")

from asyncrl.engine.models.gated_delta import delta_rule_recurrent, _expand_heads  # noqa: E402
from asyncrl.engine.models.moe import moe_experts_torch, route  # noqa: E402
from asyncrl.engine.triton_gdn import gated_delta_decode  # noqa: E402
from asyncrl.engine.triton_moe import align_pairs, fused_moe  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def test_align_pairs_groups_by_expert_in_padded_runs():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    pairs, block_expert = align_pairs(ids, 4, block_m=2)
    # flat ids [2, 0, 2, 1, 0, 2]: expert 0 pairs 1, 4 | expert 1: pair 3 + pad (6) | expert 2: 0, 2, 5 + pad
    assert pairs.tolist()[:8] == [1, 4, 3, 6, 0, 2, 5, 6]
    assert block_expert.tolist()[:4] == [0, 1, 2, 2] and set(block_expert.tolist()[4:]) == {-1}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5)] + ([(torch.bfloat16, 3e-2)] if CUDA else []))
@pytest.mark.parametrize("T,E", [(37, 8), (300, 2)])  # decode-like tiles (16 rows) and prefill-like (64)
def test_fused_moe_equals_torch_experts(dtype, tol, T, E):
    from asyncrl.engine.triton_moe import pick_block_m

    g = torch.Generator().manual_seed(0)
    H, I, K = 64, 48, 2
    assert pick_block_m(T * K, E) == (16 if T == 37 else 64)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(DEVICE, dtype)
    logits = torch.randn(T, E, generator=g).to(DEVICE, dtype)
    weights, ids = route(logits, K, renormalize=True)
    ref = moe_experts_torch(x.float(), w13.float(), w2.float(), weights.float(), ids)
    out = fused_moe(x, w13, w2, weights, ids)
    assert (out.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_kernel_equals_recurrence(state_dtype):
    """One decode step through slots [3, 0, 5] of a pool: outputs and in-place states equal the
    torch recurrence; slots not named are untouched. A bf16 pool (``mamba_ssm_cache_dtype``) is
    read into fp32, updated in fp32 (the output comes from the unrounded state) and stored rounded
    to nearest: the states are within one bf16 ulp of the fp32 reference's rounding, and on a GPU
    equal to it but where the two fp32 sums straddle a rounding boundary."""
    g = torch.Generator().manual_seed(1)
    B, HK, HV, K, V = 3, 2, 4, 16, 12
    q, k = torch.randn(B, HK, K, generator=g), torch.randn(B, HK, K, generator=g)
    v = torch.randn(B, HV, V, generator=g)
    gate, beta = -torch.rand(B, HV, generator=g), torch.rand(B, HV, generator=g)
    pool = torch.randn(6, HV, K, V, generator=g).to(state_dtype)
    slots = torch.tensor([3, 0, 5])
    qe, ke = _expand_heads(q[:, None], k[:, None], HV)
    ref_o, ref_s = delta_rule_recurrent(qe, ke, v[:, None], gate[:, None], beta[:, None], pool[slots].float())
    dev = [t.to(DEVICE) for t in (q, k, v, gate, beta, pool, slots)]
    # q, k, v as the model passes them: row-strided views of one [B, C] conv output (no copies)
    flat = torch.cat([t.reshape(B, -1) for t in dev[:3]], dim=1)
    dev[:3] = flat.split([HK * K, HK * K, HV * V], dim=1)
    dev[:3] = [t.view(B, -1, d) for t, d in zip(dev[:3], (K, K, V))]
    assert not dev[0].is_contiguous()
    out = gated_delta_decode(*dev)
    torch.testing.assert_close(out.cpu(), ref_o[:, 0], rtol=0, atol=1e-5)
    new = dev[5].cpu()
    assert new.dtype == state_dtype
    if state_dtype == torch.float32:
        torch.testing.assert_close(new[slots], ref_s, rtol=0, atol=1e-5)
    else:
        rounded = ref_s.to(state_dtype)
        torch.testing.assert_close(new[slots].float(), rounded.float(), rtol=2 ** -7, atol=1e-6)
        if CUDA:  # the GPU rounds to nearest even, as torch; triton 3.6's interpreter truncates instead
            assert (new[slots] == rounded).float().mean() > 0.99
    torch.testing.assert_close(new[[1, 2, 4]], pool[[1, 2, 4]], rtol=0, atol=0)
