"""The Triton fused-MoE kernels (both backends, every tile-table row) and the GDN decode kernel vs
their torch references.

On a GPU they run natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) the same
checks run through the Triton interpreter; otherwise the module is skipped.
"""
import warnings

import pytest
import torch
from conftest import skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from asyncrl.engine.models.gated_delta import delta_rule_recurrent, _expand_heads  # noqa: E402
from asyncrl.engine.models.moe import moe_experts_torch, route  # noqa: E402
from asyncrl.engine.triton_gdn import gated_delta_decode  # noqa: E402
from asyncrl.engine.triton_moe import (align_pairs, experts_grouped_mm, experts_triton, fused_moe,  # noqa: E402
                                       grouped_mm_supported, sum_topk)
from asyncrl.engine.triton_moe_tiles import TILE_TABLE, GemmTile, MoeTiles, default_tiles, pick_tiles  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def test_align_pairs_groups_by_expert_in_padded_runs():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    pairs, block_expert = align_pairs(ids, 4, block_m=2)
    # flat ids [2, 0, 2, 1, 0, 2]: expert 0 pairs 1, 4 | expert 1: pair 3 + pad (6) | expert 2: 0, 2, 5 + pad
    assert pairs.tolist()[:8] == [1, 4, 3, 6, 0, 2, 5, 6]
    assert block_expert.tolist()[:4] == [0, 1, 2, 2] and set(block_expert.tolist()[4:]) == {-1}


# (E, top-k, H, I): Qwen-like few experts, and 128 experts top-8 as Qwen3-30B-A3B with a small hidden
SHAPES = {"E8-top2": (8, 2, 64, 48), "E128-top8": (128, 8, 32, 16)}
DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 3e-2)}


def _moe_inputs(T, E, K, H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(DEVICE, dtype)
    weights, ids = route(torch.randn(T, E, generator=g).to(DEVICE, dtype), K, renormalize=True)
    ref = moe_experts_torch(x.float(), w13.float(), w2.float(), weights.float(), ids)
    return (x, w13, w2, weights, ids), ref


def _assert_close(out, ref, tol):
    assert out.shape == ref.shape
    err = (out.float() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 7, 64, 300])
def test_fused_moe_equals_torch_experts(T, shape, dtype):
    """The tiles ``pick_tiles`` gives (16..64-row tiles here) equal the torch reference; in bf16 the
    kernels round h and y once each (the reference keeps fp32 throughout)."""
    E, K, H, I = SHAPES[shape]
    args, ref = _moe_inputs(T, E, K, H, I, DTYPES[dtype][0])
    _assert_close(fused_moe(*args), ref, DTYPES[dtype][1])


def _table_tiles():
    rows = [t for table in TILE_TABLE.values() for _, t in table]
    return rows + [default_tiles(n * 8, 8) for n in (1, 16, 48, 300)]


@pytest.mark.parametrize("dtype", ["bf16"] + (["fp32"] if not CUDA else []))
def test_every_table_tile_equals_torch_experts(dtype):
    """Every row of the tile table (and each default bucket) through the Triton kernels, on a shape
    where its tiles overhang N and K (masks) and most of its blocks are padding or empty. fp32 only
    in the interpreter (on a GPU each row would compile twice more; fp32 is covered above)."""
    E, K, H, I = SHAPES["E8-top2"]
    args, ref = _moe_inputs(64, E, K, H, I, DTYPES[dtype][0], seed=1)
    for tiles in _table_tiles():
        _assert_close(experts_triton(*args, tiles), ref, DTYPES[dtype][1])
    # a K that the tile's BLOCK_K divides (the unmasked loop) as well
    args, ref = _moe_inputs(9, E, K, 128, 64, DTYPES[dtype][0], seed=2)
    _assert_close(experts_triton(*args, MoeTiles(16, GemmTile(32, 64), GemmTile(64, 32))), ref, DTYPES[dtype][1])


@pytest.mark.parametrize("dtype", ["bf16"] + (["fp32"] if not CUDA else []))
@pytest.mark.parametrize("T", [1, 100])
def test_grouped_mm_backend_equals_torch_experts(T, dtype):
    """``torch._grouped_mm`` GEMMs (CPU or CUDA; the engine uses them for bf16 on sm90+ only) with
    the Triton SiLU*mul and gathered top-k sum; T = 1 leaves 120 of the 128 experts empty."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    E, K, H, I = SHAPES["E128-top8"]
    args, ref = _moe_inputs(T, E, K, H, I, DTYPES[dtype][0], seed=3)
    _assert_close(experts_grouped_mm(*args), ref, DTYPES[dtype][1])


def test_tile_too_big_for_shared_memory_drops_stages_once(monkeypatch):
    """A table row whose pipeline does not fit (Triton raises OutOfResources at launch) runs with
    fewer stages, says so once, and later calls go straight to the stages that fit."""
    from triton.runtime.errors import OutOfResources

    from asyncrl.engine import triton_moe as tm

    real, tried = tm._moe_gemm_kernel, []

    class TooBigAbove2Stages:
        def __getitem__(self, grid):
            def launch(*args, num_stages, **kw):
                tried.append(num_stages)
                if num_stages > 2:
                    raise OutOfResources(232448 * num_stages // 4, 232448, "shared memory")
                return real[grid](*args, num_stages=num_stages, **kw)
            return launch

    monkeypatch.setattr(tm, "_moe_gemm_kernel", TooBigAbove2Stages())
    monkeypatch.setattr(tm, "_STAGES_THAT_FIT", {})
    E, K, H, I = SHAPES["E8-top2"]
    args, ref = _moe_inputs(7, E, K, H, I, torch.float32, seed=6)
    tiles = MoeTiles(16, GemmTile(64, 64, 4, 4), GemmTile(64, 64, 4, 2))
    with pytest.warns(UserWarning, match="num_stages=2: fix its row in triton_moe_tiles.TILE_TABLE"):
        _assert_close(experts_triton(*args, tiles), ref, 1e-5)
    assert tried == [4, 3, 2, 2]  # up: 4 -> 3 -> 2; down fits at 2
    tried.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_close(experts_triton(*args, tiles), ref, 1e-5)
    assert tried == [2, 2]


def test_sum_topk_adds_in_order_in_fp32():
    """Fixed order k = 0..K-1 in fp32: bitwise the torch loop for direct rows; gathered and
    weighted rows equal it but for the GPU's fused multiply-adds."""
    g = torch.Generator().manual_seed(4)
    T, K, H = 5, 3, 40
    y = torch.randn(T * K, H, generator=g).to(DEVICE)
    w = torch.rand(T * K, generator=g).to(DEVICE)
    perm = torch.randperm(T * K, generator=g).to(DEVICE)
    expect = y.view(T, K, H)[:, 0] * 1.0
    for k in range(1, K):
        expect = expect + y.view(T, K, H)[:, k]
    assert torch.equal(sum_topk(y, K, torch.float32), expect)
    moved = torch.empty_like(y)
    moved[perm] = y  # row perm[p] holds pair p's output
    weighted = (y * w[:, None]).view(T, K, H)
    expect = weighted[:, 0] * 1.0
    for k in range(1, K):
        expect = expect + weighted[:, k]
    torch.testing.assert_close(sum_topk(moved, K, torch.float32, rows=perm, weights=w), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 256, 16384])
def test_fused_moe_at_qwen3_30b_layer_shape(T):
    """bf16 at Qwen3-30B-A3B's layer shape (the table's own rows, both backends at prefill size)
    against the fp32 torch reference: the bf16 roundings of h and y only."""
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    E, K, H, I = 128, 8, 2048, 768
    args, ref = _moe_inputs(T, E, K, H, I, torch.bfloat16, seed=5)
    scale = ref.abs().mean().item()
    tiles = pick_tiles(T * K, E, I, H)
    outs = {"table": fused_moe(*args), "triton": experts_triton(*args, tiles)}
    if T >= 4096 and grouped_mm_supported(*args[:3]):
        outs["grouped_mm"] = experts_grouped_mm(*args)
    for name, out in outs.items():
        err = (out.float() - ref).abs()
        assert err.mean().item() <= 1e-2 * scale and err.max().item() <= 0.1 * ref.abs().max().item(), name


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
