"""The packed-heads paged decode variant (``DecodeLaunch(variant="packed")``,
``engine/triton_decode_packed.py``) equals the base kernel and a float64 reference.

GQA groups 1 / 2 / 4 / 8 (heads per program 4, 4, 4, 2: padded and full 16-row tiles), bf16 and
e4m3 caches (fp32 queries: the Triton 3.6 interpreter's ``tl.dot`` on bf16 operands is wrong, so the
CPU runs upcast the tiles to fp32 and compute in IEEE fp32), contexts that end inside, on and past
block boundaries, tiles that span several blocks, split-KV, the persistent grid, one head per
program, and cascade (shared-prefix) decode. On CPU under ``TRITON_INTERPRET=1`` (with triton
installed); the ``gpu`` test runs bf16 queries natively.
"""

import numpy as np
import pytest
import torch
from conftest import scattered_tables, skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from test_cascade import _pad, _tables, plain_attention  # noqa: E402
from test_triton_decode import _interpreter_index_on_numpy_2  # noqa: E402,F401 - autouse fixture

from asyncrl.engine.attention import FP8_KV  # noqa: E402
from asyncrl.engine.triton_decode import (DecodeLaunch, _variant_from_env,  # noqa: E402
                                          cascade_decode_attention, paged_decode_attention)
from asyncrl.engine.triton_decode_packed import heads_per_program  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
D, PAGE = 16, 4

# (name, launch) of each variant checked against the base kernel
VARIANTS = [
    ("packed", DecodeLaunch(block_n=4, variant="packed")),
    ("packed, tile over 2 blocks, fp8 tile 16", DecodeLaunch(block_n=8, variant="packed", fp8_block_n=16)),
    ("packed, split-KV 2, table in registers", DecodeLaunch(block_n=4, kv_splits=2, variant="packed",
                                                            table_in_registers=True)),
    ("packed, persistent, table in registers", DecodeLaunch(block_n=4, kv_splits=1, variant="packed",
                                                            persistent_per_sm=1, table_in_registers=True)),
    ("packed, 1 head per program, persistent, split 4",
     DecodeLaunch(block_n=4, kv_splits=4, variant="packed", heads_per_program=1, persistent_per_sm=1)),
]


def _case(group: int, kv_dtype: torch.dtype, seed: int):
    """4 kv heads; contexts 1, PAGE - 1, PAGE, PAGE + 1, 5 PAGE + 3 over scattered blocks."""
    hkv = 4
    g = torch.Generator().manual_seed(seed)
    lens = [1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE + 3]
    nb = sum(-(-n // PAGE) for n in lens)
    tables, bt = scattered_tables(lens, PAGE, nb, g)
    kc = torch.randn(nb + 1, PAGE, hkv, D, generator=g).to(kv_dtype)
    vc = torch.randn(nb + 1, PAGE, hkv, D, generator=g).to(kv_dtype)
    q = torch.randn(len(lens), hkv * group, D, generator=g)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), tables


@pytest.fixture
def packed_calls(monkeypatch):
    """Counts the packed kernel's launches (so a silent fall-back to the base kernel fails)."""
    from asyncrl.engine import triton_decode_packed

    calls = []
    original = triton_decode_packed.launch_packed
    monkeypatch.setattr(triton_decode_packed, "launch_packed", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_KV], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_packed_variants_equal_base_kernel_and_float64(group, kv_dtype, packed_calls):
    q, kc, vc, bt, lens, tables = _case(group, kv_dtype, seed=group)
    scale = D ** -0.5
    ref = plain_attention(q.double(), kc.double(), vc.double(), tables, lens.numpy(), scale)
    dev = [t.to(DEVICE) for t in (q, kc, vc, bt, lens)]
    base = paged_decode_attention(*dev, scale, launch=DecodeLaunch(block_n=4, kv_splits=1)).cpu()
    torch.testing.assert_close(base.double(), ref, rtol=0, atol=1e-5)
    variants = VARIANTS if group in (2, 4) else VARIANTS[:3]  # every variant at the groups that pack 16 rows
    for name, launch in variants:
        out = paged_decode_attention(*dev, scale, launch=launch).cpu()
        torch.testing.assert_close(out, base, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert len(packed_calls) == len(variants)
    for launch in (DecodeLaunch(block_n=4, kv_splits=1, table_in_registers=True),  # the base kernel, table read once
                   DecodeLaunch(block_n=4, kv_splits=2, table_in_registers=True)):
        out = paged_decode_attention(*dev, scale, launch=launch).cpu()
        torch.testing.assert_close(out, base, rtol=0, atol=1e-5, msg=lambda m: f"{launch}: {m}")
    assert len(packed_calls) == len(variants)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_KV], ids=["bf16", "e4m3"])
def test_packed_cascade_equals_base_cascade_and_float64(kv_dtype, packed_calls):
    """Cascade decode (prefix kernel + suffix decode) with the packed suffix kernel, GQA 2."""
    from asyncrl.engine.cascade import cascade_attention_reference, plan_cascade, tile_shape

    H, Hkv = 4, 2
    groups, prefix = [3, 1, 2], [2, 3, 1]
    g = torch.Generator().manual_seed(5)
    suffix = torch.randint(1, 3 * PAGE, (sum(groups),), generator=g).tolist()
    tables, ctx, nb = _tables(groups, PAGE, prefix, suffix, seed=5)
    kc = torch.randn(nb + 1, PAGE, Hkv, D, generator=g).to(kv_dtype)
    vc = torch.randn(nb + 1, PAGE, Hkv, D, generator=g).to(kv_dtype)
    B = len(tables)
    q = torch.randn(B, H, D, generator=g)
    bt_np, ctx_np = _pad(tables, max(len(t) for t in tables) + 1, nb), np.asarray(ctx, dtype=np.int32)
    _, mpt = tile_shape(H // Hkv)
    plan = plan_cascade(bt_np, ctx_np, PAGE, mpt, bs=B, min_saved_fraction=0.0)
    packed = torch.from_numpy(plan.packed()).to(DEVICE)
    dev = [t.to(DEVICE) for t in (q, kc, vc, torch.from_numpy(bt_np), torch.from_numpy(ctx_np))]
    args = (*dev, packed[:B], packed[B:].view(-1, 2 + mpt), D ** -0.5)
    base = cascade_decode_attention(*args, launch=DecodeLaunch(block_n=4))
    base_table = cascade_decode_attention(*args, launch=DecodeLaunch(block_n=4, table_in_registers=True))
    torch.testing.assert_close(base_table.cpu(), base.cpu(), rtol=0, atol=1e-5)
    out = cascade_decode_attention(*args, launch=DecodeLaunch(block_n=4, variant="packed", persistent_per_sm=1,
                                                              table_in_registers=True))
    ref = cascade_attention_reference(q.double(), kc.double(), vc.double(), tables, ctx, plan, D ** -0.5)
    torch.testing.assert_close(out.cpu(), base.cpu(), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=0, atol=1e-5)
    assert len(packed_calls) == 1


def test_packed_verify_step_falls_back_to_base(packed_calls):
    """Several query tokens per sequence (a speculative verify step) run the base kernel (also with
    its block table in registers and split-KV)."""
    q, kc, vc, bt, lens, _ = _case(2, torch.float32, seed=0)
    q3 = q.repeat_interleave(3, 0)
    lens = lens.clamp(min=3)  # each sequence holds its 3 query tokens (the blocks hold >= 4 tokens)
    dev = [t.to(DEVICE) for t in (q3, kc, vc, bt, lens)]
    base = paged_decode_attention(*dev, D ** -0.5, launch=DecodeLaunch(block_n=4, kv_splits=1), query_len=3)
    out = paged_decode_attention(*dev, D ** -0.5, launch=DecodeLaunch(block_n=4, kv_splits=1, variant="packed"),
                                 query_len=3)
    assert torch.equal(out, base) and not packed_calls
    table = paged_decode_attention(*dev, D ** -0.5, query_len=3,
                                   launch=DecodeLaunch(block_n=4, kv_splits=2, table_in_registers=True))
    torch.testing.assert_close(table, base, rtol=0, atol=1e-5, equal_nan=False)


def test_heads_per_program_and_env_switch(monkeypatch):
    assert [heads_per_program(gq, 8) for gq in (1, 2, 4, 8, 16)] == [4, 4, 4, 2, 1]  # D 128: <= 512 columns
    assert [heads_per_program(gq, 8, block_d=64) for gq in (1, 2, 4)] == [8, 8, 4]
    assert heads_per_program(2, 4, block_d=16) == 4 and heads_per_program(2, 6, block_d=16) == 2
    with pytest.raises(ValueError, match="does not divide the 8 kv heads"):
        heads_per_program(2, 8, requested=3)
    monkeypatch.setenv("ASYNCRL_DECODE_VARIANT", "packed,4,2,32,1")
    launch = _variant_from_env(DecodeLaunch(), shaped=False)
    assert (launch.variant, launch.heads_per_program, launch.persistent_per_sm, launch.block_n, launch.fp8_block_n,
            launch.table_in_registers, launch.num_stages) == ("packed", 4, 2, 16, 32, True, 3)
    monkeypatch.setenv("ASYNCRL_DECODE_VARIANT", "packed,0,0,0,0")
    assert not _variant_from_env(DecodeLaunch(), shaped=False).table_in_registers
    assert _variant_from_env(DecodeLaunch(block_n=32), shaped=True).block_n == 32
    monkeypatch.setenv("ASYNCRL_DECODE_VARIANT", "base,1")
    launch = _variant_from_env(DecodeLaunch(block_n=32), shaped=True)
    assert (launch.variant, launch.block_n, launch.table_in_registers) == ("base", 32, True)
    monkeypatch.setenv("ASYNCRL_DECODE_VARIANT", "fast")
    with pytest.raises(ValueError, match="the variants are 'base' and 'packed'"):
        _variant_from_env(DecodeLaunch(), shaped=False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_KV], ids=["bf16", "e4m3"])
def test_gpu_packed_bf16_at_the_06b_shape_equals_base(kv_dtype):
    """bf16 queries at the Qwen3-0.6B shape (16 q / 8 kv heads, D 128, block 64), the engine's
    launches: the packed variant (its default, persistent, split, 8-head and 1-head forms) equals the
    base kernel within bf16 rounding and the float64 reference."""
    from asyncrl.engine.triton_decode import PACKED_LAUNCH
    import dataclasses

    torch.manual_seed(0)
    B, H, HKV, DH, page = 12, 16, 8, 128, 64
    lens = torch.tensor([1, 63, 64, 65, 260, 384, 512, 1000, 1500, 2300, 129, 7], dtype=torch.int32)
    per = (-(-lens // page)).tolist()
    perm = torch.randperm(sum(per)).tolist()
    tables, o = [], 0
    for k in per:
        tables.append(perm[o:o + k])
        o += k
    bt = torch.tensor([t + [0] * (max(per) - len(t)) for t in tables], dtype=torch.int32).cuda()
    kc = torch.randn(sum(per), page, HKV, DH, device="cuda").to(kv_dtype)
    vc = torch.randn_like(kc, dtype=torch.float32).to(kv_dtype)
    q = torch.randn(B, H, DH, device="cuda", dtype=torch.bfloat16)
    scale = DH ** -0.5
    ref = plain_attention(q.double().cpu(), kc.double().cpu(), vc.double().cpu(), tables, lens.numpy(), scale)
    lens = lens.cuda()
    base = paged_decode_attention(q, kc, vc, bt, lens, scale, launch=DecodeLaunch())
    for launch in (PACKED_LAUNCH, dataclasses.replace(PACKED_LAUNCH, persistent_per_sm=2),
                   dataclasses.replace(PACKED_LAUNCH, kv_splits=4),
                   dataclasses.replace(PACKED_LAUNCH, table_in_registers=False, num_stages=2, heads_per_program=8),
                   DecodeLaunch(64, 4, 4, variant="packed", heads_per_program=1, table_in_registers=True)):
        out = paged_decode_attention(q, kc, vc, bt, lens, scale, launch=launch)
        torch.testing.assert_close(out.float(), base.float(), rtol=0, atol=2e-2, msg=lambda m: f"{launch}: {m}")
        torch.testing.assert_close(out.double().cpu(), ref, rtol=0, atol=2e-2, msg=lambda m: f"{launch}: {m}")
