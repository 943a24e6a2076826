"""The Triton paged-decode kernel with several query tokens per sequence (a speculative verify
step: the last token and its drafts, causal among themselves) vs the gathered reference.

On a GPU it runs natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) through the
Triton interpreter; otherwise the module is skipped.
"""

import dataclasses

import pytest
import torch
from conftest import scattered_tables, skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from asyncrl.engine.attention import build_gathered_metadata, gathered_attention  # noqa: E402
from asyncrl.engine.cascade import CascadeLaunchRule  # noqa: E402
from asyncrl.engine.triton_decode import DecodeLaunch, paged_decode_attention  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(autouse=True)
def _interpreter_index_on_numpy_2(monkeypatch):
    """Triton 3.6's interpreter turns a loaded scalar into a loop bound with ``int(array)``, which
    numpy >= 2.3 refuses for its 1-element arrays; the kernel loops to each sequence's loaded
    context length, so the interpreter gets ``int(array.item())`` instead. No effect on a GPU."""
    if CUDA:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


@pytest.mark.parametrize("query_len,kv_splits,prefetch,ordered", [
    (1, 1, False, False), (3, 1, False, False), (4, 2, False, False), (5, 4, False, False),
    (1, 1, True, False), (3, 1, True, False), (5, 4, True, False), (1, 1, False, True), (4, 2, True, True)])
def test_multi_query_paged_decode_matches_gathered(query_len, kv_splits, prefetch, ordered):
    """Contexts shorter than a page, exactly a page, over several scattered pages; split-KV
    chunks that hold no key a row may see (the -inf running max guard); block ids prefetched a tile
    ahead (``bt_prefetch``: one tile per page; 16 tokens on a GPU, whose ``tl.dot`` needs K >= 16);
    programs dispatched longest sequence first (``longest_first``, the order computed by the call)."""
    H, Hkv, D, page = 4, 2, 16, 16 if (prefetch and CUDA) else 4
    g = torch.Generator().manual_seed(query_len)
    lens = [query_len, query_len + 1, page + 1, 3 * page + 2]
    nb = sum(-(-n // page) for n in lens) + 2
    kc = torch.randn(nb + 1, page, Hkv, D, generator=g)
    vc = torch.randn(nb + 1, page, Hkv, D, generator=g)
    tables, bt = scattered_tables(lens, page, nb, g)
    q = torch.randn(len(lens) * query_len, H, D, generator=g)
    dev = [t.to(DEVICE) for t in (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32))]
    launch = DecodeLaunch(block_n=page if prefetch else 16, kv_splits=kv_splits, table_prefetch=prefetch,
                          longest_first=ordered)
    out = paged_decode_attention(*dev, D ** -0.5, launch=launch, query_len=query_len)
    meta = build_gathered_metadata(tables, [n - query_len for n in lens], [query_len] * len(lens), page, nb,
                                   torch.device("cpu"))
    ref = gathered_attention(q, kc, vc, meta, D ** -0.5)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=1e-4)


def _assert_matches_gathered(out, q, kc, vc, tables, lens, query_len, page, nb, low_precision):
    """``out`` (the kernel's, any device) equals the gathered path's attention over the same q / caches:
    to fp32 rounding, or with ``low_precision`` (bf16 queries, e4m3 caches) within bf16 rounding of float64."""
    D = q.shape[-1]
    meta = build_gathered_metadata(tables, [n - query_len for n in lens], [query_len] * len(lens), page, nb,
                                   torch.device("cpu"))
    if low_precision:
        ref = gathered_attention(q.double(), kc.double(), vc.double(), meta, D ** -0.5)
        torch.testing.assert_close(out.cpu().double(), ref, rtol=2 ** -8, atol=1e-2)
    else:
        ref = gathered_attention(q, kc, vc, meta, D ** -0.5)
        torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("query_len,kv_splits,prefetch,lazy,sharp,fp8", [
    (1, 1, False, False, False, False), (1, 1, True, True, False, False), (1, 1, True, True, True, False),
    (1, 2, False, True, True, False), (3, 1, True, False, False, False), (3, 2, False, True, True, False),
    (1, 1, True, True, True, True), (1, 2, False, False, True, True)])
def test_tiled_loads_and_lazy_rescale_match_gathered(query_len, kv_splits, prefetch, lazy, sharp, fp8):
    """``tiled_loads`` (a tile's addresses = its block's base + fixed offsets, full tiles unmasked, the partial
    last one masked) and ``lazy_rescale`` (the running max moves only by more than ``RESCALE_THRESHOLD``):
    the same attention as the gathered path. Contexts end mid-tile, on a tile and on a page; ``sharp`` scales
    the queries so scores spread over ~+-30 and the max moves past the threshold within a sequence (both
    branches of the lazy rescale run; under an e4m3 cache with bf16 queries, ``fp8``, p enters an fp16 dot, so
    a max that did not move when it had to would overflow it); split-KV chunks and verify steps of 3 tokens
    (no lazy rescale there)."""
    from asyncrl.engine.attention import FP8_KV

    H, Hkv, D, page = 4, 2, 16, 16 if CUDA else 8
    block_n = 16 if CUDA else 4
    g = torch.Generator().manual_seed(20 + query_len + 2 * kv_splits)
    lens = [query_len, query_len + block_n, 2 * page, 3 * page + 3, 5 * page - 1]
    nb = sum(-(-n // page) for n in lens) + 2
    kc = torch.randn(nb + 1, page, Hkv, D, generator=g)
    vc = torch.randn(nb + 1, page, Hkv, D, generator=g)
    tables, bt = scattered_tables(lens, page, nb, g)
    q = torch.randn(len(lens) * query_len, H, D, generator=g) * (8.0 if sharp else 1.0)
    if fp8:
        kc, vc, q = kc.to(FP8_KV), vc.to(FP8_KV), q.to(torch.bfloat16)
    dev = [t.to(DEVICE) for t in (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32))]
    launch = DecodeLaunch(block_n=block_n, kv_splits=kv_splits, table_prefetch=prefetch, tiled_loads=True,
                          lazy_rescale=lazy)
    out = paged_decode_attention(*dev, D ** -0.5, launch=launch, query_len=query_len)
    _assert_matches_gathered(out, q, kc, vc, tables, lens, query_len, page, nb, low_precision=fp8)


@pytest.mark.parametrize("tiled", [False, True])
def test_head_major_caches_give_the_same_attention(tiled):
    """The kernel addresses K/V through the cache's strides, so the same values stored head-major (HND: a block
    holds each head's page of keys contiguously; ``bench/paged_decode_variants.py --layouts hnd`` times it) give
    the same output bit for bit as the engine's token-major caches, on the plain and the tiled-load paths."""
    H, Hkv, D, page = 4, 2, 16, 16 if CUDA else 8
    block_n = 16 if CUDA else 4
    g = torch.Generator().manual_seed(7)
    lens = [1, block_n + 3, 2 * page, 3 * page + 5]
    nb = sum(-(-n // page) for n in lens) + 2
    kc = torch.randn(nb + 1, page, Hkv, D, generator=g)
    vc = torch.randn(nb + 1, page, Hkv, D, generator=g)
    _, bt = scattered_tables(lens, page, nb, g)
    q = torch.randn(len(lens), H, D, generator=g)
    q, kc, vc, bt, cl = [t.to(DEVICE) for t in (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32))]
    kh, vh = (c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for c in (kc, vc))
    assert kh.stride(1) == D and kh.stride(2) == page * D and torch.equal(kh, kc)
    launch = DecodeLaunch(block_n=block_n, table_prefetch=tiled, tiled_loads=tiled, lazy_rescale=tiled)
    token_major = paged_decode_attention(q, kc, vc, bt, cl, D ** -0.5, launch=launch)
    torch.testing.assert_close(paged_decode_attention(q, kh, vh, bt, cl, D ** -0.5, launch=launch), token_major,
                               rtol=0, atol=0)


@pytest.mark.parametrize("query_len,bf16,max_registers", [(1, False, 0), (3, False, 0), (3, True, 0), (1, True, 128)])
def test_fp8_cache_paged_decode_matches_gathered(query_len, bf16, max_registers):
    """An e4m3 KV cache (``kv_cache_dtype="fp8"``): the kernel upcasts each K/V tile to the query's
    dtype as it loads it, the gathered path upcasts the gathered keys: same attention. bf16 queries (a
    verify step of 3 tokens) take the fp16 dots (``f16_dots``): within bf16 rounding of float64. A register
    cap (``max_registers``, on a GPU) changes nothing but the compiled code's register use."""
    from asyncrl.engine.attention import FP8_KV

    H, Hkv, D, page = 4, 2, 16, 4
    g = torch.Generator().manual_seed(10 + query_len)
    lens = [query_len + 1, 3 * page + 2]
    nb = sum(-(-n // page) for n in lens) + 1
    kc = torch.randn(nb + 1, page, Hkv, D, generator=g).to(FP8_KV)
    vc = torch.randn(nb + 1, page, Hkv, D, generator=g).to(FP8_KV)
    tables, o = [], 0
    for n in lens:
        tables.append(list(range(o, o + -(-n // page))))
        o += len(tables[-1])
    width = max(map(len, tables))
    bt = torch.tensor([t + [nb] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens) * query_len, H, D, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
    dev = [t.to(DEVICE) for t in (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32))]
    launch = DecodeLaunch(block_n=16, kv_splits=1, max_registers=max_registers)
    out = paged_decode_attention(*dev, D ** -0.5, launch=launch, query_len=query_len)
    _assert_matches_gathered(out, q, kc, vc, tables, lens, query_len, page, nb, low_precision=bf16)


def test_f16_dots_only_for_an_e4m3_cache_under_a_bf16_query():
    """The fp16 dots apply where they are exact and cheaper (e4m3 K/V, bf16 q), and can be switched off."""
    from asyncrl.engine.attention import FP8_KV
    from asyncrl.engine.triton_decode import f16_dots

    q16, q32 = torch.zeros(1, 2, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 16)
    fp8, bf16 = torch.zeros(1, 4, 1, 16, dtype=FP8_KV), torch.zeros(1, 4, 1, 16, dtype=torch.bfloat16)
    assert f16_dots(q16, fp8) and f16_dots(q16, fp8, DecodeLaunch())
    assert not f16_dots(q16, bf16) and not f16_dots(q32, fp8)
    assert not f16_dots(q16, fp8, DecodeLaunch(fp8_f16_dots=False))


def test_any_program_order_gives_the_same_attention_and_the_order_is_made_once_per_step():
    """``longest_first``: program (kv head, rank) takes sequence ``order[rank]``; every sequence's output
    is its own, so any permutation gives the unordered result. The order comes from a callable only when
    the launch orders (``AttentionMetadata.decode_order``: made once, shared by a step's layers), longest
    first with ties in batch order."""
    from asyncrl.engine.attention import AttentionMetadata
    from asyncrl.engine.triton_decode import longest_first_order

    H, Hkv, D, page = 4, 2, 16, 16
    g = torch.Generator().manual_seed(7)
    lens = [5, 40, 17, 40, 1]
    nb = sum(-(-n // page) for n in lens)
    kc, vc = torch.randn(nb + 1, page, Hkv, D, generator=g), torch.randn(nb + 1, page, Hkv, D, generator=g)
    tables, o = [], 0
    for n in lens:
        tables.append(list(range(o, o + -(-n // page))))
        o += len(tables[-1])
    bt = torch.tensor([t + [nb] * (3 - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), H, D, generator=g)
    ctx = torch.tensor(lens, dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (q, kc, vc, bt, ctx)]
    plain = paged_decode_attention(*dev, D ** -0.5, launch=DecodeLaunch(block_n=16, kv_splits=1))
    ordered = DecodeLaunch(block_n=16, kv_splits=1, longest_first=True)
    for order in ([1, 3, 2, 0, 4], [4, 0, 2, 1, 3]):  # longest first; and an arbitrary permutation
        given = torch.tensor(order, dtype=torch.int32, device=DEVICE)
        out = paged_decode_attention(*dev, D ** -0.5, launch=ordered, order=lambda: given)
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    assert longest_first_order(ctx).tolist() == [1, 3, 2, 0, 4]
    calls = []

    def order_fn():
        calls.append(1)
        return longest_first_order(dev[4])

    paged_decode_attention(*dev, D ** -0.5, launch=DecodeLaunch(block_n=16, kv_splits=1), order=order_fn)
    assert not calls  # an unordered launch never asks
    torch.testing.assert_close(paged_decode_attention(*dev, D ** -0.5, launch=ordered, order=order_fn), plain,
                               rtol=0, atol=1e-5)
    assert calls == [1]
    meta = AttentionMetadata(slot_mapping=ctx, block_tables=bt, context_lens=ctx, paged_decode=True)
    first = meta.decode_order()
    assert meta.decode_order() is first and first.tolist() == [1, 3, 2, 0, 4]


def test_default_launch_is_one_warp_tiled_and_16_token_tiles_on_dense_e4m3_grids(monkeypatch):
    """The launch a decode call gets when it names none (``default_launch``): one-warp programs, longest sequence
    first, block ids prefetched, tiled loads and the lazy rescale, on 32-token tiles, or 16 on an e4m3 cache
    from ``FP8_SMALL_TILES_MIN_PROGRAMS_PER_SM`` (sequence, kv head) programs per SM (off CUDA: 8 SMs); heads
    wider than ``ONE_WARP_MAX_HEAD_DIM`` keep 4 warps; none of it for verify steps (several query tokens), nor
    over a launch set in the environment or by a bench."""
    from asyncrl.engine import triton_decode as td
    from asyncrl.engine.attention import FP8_KV

    bf16 = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16)
    fp8 = bf16.to(FP8_KV)
    monkeypatch.setattr(td, "_LAUNCH_PINNED", False)
    dense = -(-td.FP8_SMALL_TILES_MIN_PROGRAMS_PER_SM * td.num_sms(bf16.device) // 2)  # sequences at 2 kv heads
    tiled = DecodeLaunch(32, 1, 3, table_prefetch=True, longest_first=True, tiled_loads=True, lazy_rescale=True)
    assert td.default_launch(dense, 2, fp8) == dataclasses.replace(tiled, block_n=16)
    for batch, cache in ((1, bf16), (dense, bf16), (dense - 1, fp8), (1, fp8)):
        assert td.default_launch(batch, 2, cache) == tiled
    wide = torch.zeros(1, 4, 2, td.ONE_WARP_MAX_HEAD_DIM * 2, dtype=torch.bfloat16)
    assert td.default_launch(dense, 2, wide) == DecodeLaunch(table_prefetch=True, longest_first=True)
    assert td.default_launch(dense, 2, wide.to(FP8_KV)).num_warps == 4
    assert td.default_launch(dense, 2, bf16, qlen=3) is td.DECODE_LAUNCH
    custom = DecodeLaunch(block_n=32)  # a bench's own launch in DECODE_LAUNCH: kept, not rebuilt from the default
    monkeypatch.setattr(td, "DECODE_LAUNCH", custom)
    assert td.default_launch(dense, 2, bf16) is custom and td.default_launch(1, 2, fp8) is custom
    monkeypatch.setattr(td, "DECODE_LAUNCH", DecodeLaunch())
    monkeypatch.setattr(td, "_LAUNCH_PINNED", True)
    assert td.default_launch(dense, 2, bf16) is td.DECODE_LAUNCH


@pytest.mark.parametrize("fp8", [False, True])
def test_every_launch_the_default_rule_picks_matches_gathered(fp8, monkeypatch):
    """The launches ``default_launch`` gives a plain decode as the batch grows (one SM: 32-token tiles on one
    warp, on an e4m3 cache 16-token tiles from 12 programs per SM; both tiled with the lazy rescale), over
    contexts of one token to several pages (tiles that end mid-tile, on a tile and on a page): the gathered
    path's attention."""
    from asyncrl.engine import triton_decode as td
    from asyncrl.engine.attention import FP8_KV

    monkeypatch.setattr(td, "num_sms", lambda device: 1)
    monkeypatch.setattr(td, "_LAUNCH_PINNED", False)
    monkeypatch.setattr(td, "DECODE_LAUNCH", DecodeLaunch())
    H, Hkv, D, page = 4, 2, 16, 32
    g = torch.Generator().manual_seed(7)
    picked = set()
    for batch in (3, 4, 6):
        lens = [1 + (37 * i) % (4 * page) for i in range(batch)]
        nb = sum(-(-n // page) for n in lens) + 1
        kc, vc = (torch.randn(nb + 1, page, Hkv, D, generator=g) for _ in range(2))
        if fp8:
            kc, vc = kc.to(FP8_KV), vc.to(FP8_KV)
        tables, bt = scattered_tables(lens, page, nb, g)
        q = torch.randn(batch, H, D, generator=g)
        dev = [t.to(DEVICE) for t in (q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32))]
        picked.add(td.default_launch(batch, Hkv, dev[1]))
        out = paged_decode_attention(*dev, D ** -0.5)
        meta = build_gathered_metadata(tables, [n - 1 for n in lens], [1] * batch, page, nb, torch.device("cpu"))
        torch.testing.assert_close(out.cpu(), gathered_attention(q, kc, vc, meta, D ** -0.5), rtol=0, atol=1e-4)
    assert len(picked) == (2 if fp8 else 1) and all(launch.tiled_loads for launch in picked)


def test_fp8_cache_bf16_query_fp16_dots_are_at_least_as_accurate_as_bf16_dots():
    """bf16 queries on an e4m3 cache: the fp16 dots (the default) and the bf16 dots both stay within bf16
    rounding of the float64 attention over the same K/V, plain and cascade decode, and the fp16 path's mean
    error is no larger (e4m3 K/V and the bf16 query are exact in fp16; p gets 3 more mantissa bits).
    The bf16 dots run on a GPU only: Triton 3.6's interpreter converts e4m3 to bf16 wrongly (outputs ~1e9)."""
    import numpy as np
    from test_cascade import _pad, _tables

    from asyncrl.engine.attention import FP8_KV
    from asyncrl.engine.cascade import cascade_attention_reference, plan_cascade, tile_shape
    from asyncrl.engine.triton_decode import cascade_decode_attention

    H, Hkv, D, page = 4, 2, 16, 4
    groups, prefix = [3, 1, 2], [2, 3, 1]
    g = torch.Generator().manual_seed(7)
    suffix = torch.randint(1, 3 * page, (sum(groups),), generator=g).tolist()
    tables, ctx, nb = _tables(groups, page, prefix, suffix, seed=7)
    kc = (3 * torch.randn(nb + 1, page, Hkv, D, generator=g)).to(FP8_KV)
    vc = torch.randn(nb + 1, page, Hkv, D, generator=g).to(FP8_KV)
    B = len(tables)
    q = (2 * torch.randn(B, H, D, generator=g)).to(torch.bfloat16)
    bt_np, ctx_np = _pad(tables, max(len(t) for t in tables) + 1, nb), np.asarray(ctx, dtype=np.int32)
    _, mpt = tile_shape(H // Hkv)
    plan = plan_cascade(bt_np, ctx_np, page, mpt, bs=B, min_saved_fraction=0.0)
    packed = torch.from_numpy(plan.packed()).to(DEVICE)
    ref = cascade_attention_reference(q.double(), kc.double(), vc.double(), tables, ctx, plan, D ** -0.5)
    dev = [t.to(DEVICE) for t in (q, kc, vc, torch.from_numpy(bt_np), torch.from_numpy(ctx_np))]
    errors = {}
    for f16 in (True, False) if CUDA else (True,):
        launch = DecodeLaunch(block_n=16, kv_splits=1, fp8_f16_dots=f16)
        plain = paged_decode_attention(*dev, D ** -0.5, launch=launch)
        errors[f16] = (plain.cpu().double() - ref).abs()
        torch.testing.assert_close(plain.cpu().double(), ref, rtol=0, atol=2e-2)
    out = cascade_decode_attention(*dev, packed[:B], packed[B:].view(-1, 2 + mpt), D ** -0.5,
                                   launch=DecodeLaunch(block_n=16, kv_splits=1))
    # the prefix partials are kept in q's dtype (``prefix_partials``): two bf16 roundings, not one
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2 ** -7, atol=2e-2)
    if CUDA:
        assert errors[True].mean() <= errors[False].mean() * 1.05, (errors[True].mean(), errors[False].mean())


def test_fp8_cache_cascade_decode_matches_plain_and_reference():
    """Cascade decode (shared-prefix kernel + suffix decode) on an e4m3 cache: equal to plain paged
    decode and to the float64 reference over the same (upcast) K/V."""
    import numpy as np
    from test_cascade import _pad, _tables

    from asyncrl.engine.attention import FP8_KV
    from asyncrl.engine.cascade import cascade_attention_reference, plan_cascade, tile_shape
    from asyncrl.engine.triton_decode import cascade_decode_attention

    H, Hkv, D, page = 4, 2, 16, 4
    groups, prefix = [3, 1, 2], [2, 3, 1]
    g = torch.Generator().manual_seed(0)
    suffix = torch.randint(1, 3 * page, (sum(groups),), generator=g).tolist()
    tables, ctx, nb = _tables(groups, page, prefix, suffix, seed=0)
    kc = torch.randn(nb + 1, page, Hkv, D, generator=g).to(FP8_KV)
    vc = torch.randn(nb + 1, page, Hkv, D, generator=g).to(FP8_KV)
    B = len(tables)
    q = torch.randn(B, H, D, generator=g)
    bt_np, ctx_np = _pad(tables, max(len(t) for t in tables) + 1, nb), np.asarray(ctx, dtype=np.int32)
    _, mpt = tile_shape(H // Hkv)
    plan = plan_cascade(bt_np, ctx_np, page, mpt, bs=B, min_saved_fraction=0.0)
    packed = torch.from_numpy(plan.packed()).to(DEVICE)
    q, kc, vc, bt, cl = (t.to(DEVICE) for t in (q, kc, vc, torch.from_numpy(bt_np), torch.from_numpy(ctx_np)))
    out = cascade_decode_attention(q, kc, vc, bt, cl, packed[:B], packed[B:].view(-1, 2 + mpt), D ** -0.5)
    plain = paged_decode_attention(q, kc, vc, bt, cl, D ** -0.5)
    ref = cascade_attention_reference(q.double().cpu(), kc.cpu().double(), vc.cpu().double(), tables, ctx, plan,
                                      D ** -0.5)
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-4)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=0, atol=1e-4)


# (prefix chunks in the plan header, the launch rule, a suffix launch or None = the rule's)
CASCADE_LAUNCHES = [
    # the launch before 2026-12-02 (1 chunk, the plain decode's suffix tile)
    (1, CascadeLaunchRule(prefix_fill=0, prefix_block_n=4, small_batch_rows=0), None),
    (2, CascadeLaunchRule(prefix_block_n=4), None),  # the defaults: 2 chunks, the small-batch suffix tile
    (2, CascadeLaunchRule(prefix_fill=1, max_prefix_splits=2, prefix_block_n=4), None),
    # 3 chunks of 8 tokens (a tile's last chunk may be empty), suffix split-KV 2
    (3, CascadeLaunchRule(prefix_fill=1, max_prefix_splits=4, prefix_block_n=4, suffix_kv_splits=2), None),
    # prefix part 0 starts the suffix's online softmax (EARLY_PREFIX), alone and with split-KV
    (1, CascadeLaunchRule(prefix_block_n=4, suffix_early_prefix=1), None),
    (2, CascadeLaunchRule(prefix_fill=1, max_prefix_splits=2, prefix_block_n=4, suffix_kv_splits=2,
                          suffix_early_prefix=1), None),
    # suffix tiles over 2 blocks (per-token lookup), 4 chunks of the suffix, 8 prefix warps
    (4, CascadeLaunchRule(prefix_fill=1, max_prefix_splits=4, prefix_block_n=4, prefix_warps=8,
                          suffix_kv_splits=4, suffix_block_n=8, suffix_warps=2, suffix_stages=2), None),
    # a header count above the partials' depth is clamped to it (2)
    (8, CascadeLaunchRule(prefix_fill=1, max_prefix_splits=2, prefix_block_n=4, suffix_kv_splits=2),
     DecodeLaunch(block_n=4, table_in_registers=True)),
    (2, CascadeLaunchRule(prefix_fill=1, max_prefix_splits=2, prefix_block_n=4, suffix_kv_splits=2),
     DecodeLaunch(block_n=4, table_prefetch=True)),
    (4, CascadeLaunchRule(prefix_fill=1, max_prefix_splits=4, prefix_block_n=4),
     DecodeLaunch(block_n=4, variant="packed", persistent_per_sm=1)),
    # block ids prefetched a tile ahead in the prefix kernel (any cache), 1 to 4 chunks
    (1, CascadeLaunchRule(prefix_fill=0, prefix_block_n=4, prefix_prefetch=2), None),
    (4, CascadeLaunchRule(prefix_fill=1, max_prefix_splits=4, prefix_block_n=4, prefix_prefetch=2),
     DecodeLaunch(block_n=4, table_prefetch=True)),
]


@pytest.mark.skipif(CUDA, reason="4-token tiles (below tl.dot's K >= 16 on a GPU) keep the interpreter run small; "
                                  "test_gpu.py runs the split launches at real tile sizes")
def test_cascade_split_launches_match_plain_and_float64():
    """Cascade decode with the prefix split into chunks (count read from the plan header on the
    device) and the suffix split-KV (chunk 0 merges the prefix parts): every launch equals plain
    paged decode and the float64 reference. Prefixes of 1, 3, 4 and 6 blocks (chunks that hold
    nothing), a singleton row (no prefix: its whole context split), suffixes up to 5 blocks."""
    import numpy as np
    from test_cascade import _pad, _tables

    from asyncrl.engine.cascade import cascade_attention_reference, plan_cascade, tile_shape
    from asyncrl.engine.triton_decode import cascade_decode_attention

    H, Hkv, D, page = 4, 2, 16, 4
    groups, prefix = [3, 1, 2, 2], [4, 3, 1, 6]
    g = torch.Generator().manual_seed(3)
    suffix = torch.randint(1, 5 * page, (sum(groups),), generator=g).tolist()
    suffix[0], suffix[1] = 1, 5 * page  # the current token only; a suffix of several chunks
    tables, ctx, nb = _tables(groups, page, prefix, suffix, seed=3)
    kc, vc = (torch.randn(nb + 1, page, Hkv, D, generator=g) for _ in range(2))
    B = len(tables)
    q = torch.randn(B, H, D, generator=g)
    bt_np, ctx_np = _pad(tables, max(len(t) for t in tables) + 1, nb), np.asarray(ctx, dtype=np.int32)
    _, mpt = tile_shape(H // Hkv)
    plan = plan_cascade(bt_np, ctx_np, page, mpt, bs=B, min_saved_fraction=0.0)
    dev = [t.to(DEVICE) for t in (q, kc, vc, torch.from_numpy(bt_np), torch.from_numpy(ctx_np))]
    plain = paged_decode_attention(*dev, D ** -0.5, launch=DecodeLaunch(block_n=4, kv_splits=1))
    ref = cascade_attention_reference(q.double(), kc.double(), vc.double(), tables, ctx, plan, D ** -0.5)
    torch.testing.assert_close(plain.cpu().double(), ref, rtol=0, atol=1e-5)
    for chunks, rule, launch in CASCADE_LAUNCHES:
        plan.prefix_splits = chunks
        packed = torch.from_numpy(plan.packed()).to(DEVICE)
        assert packed[B + 1].item() == chunks
        out = cascade_decode_attention(*dev, packed[:B], packed[B:].view(-1, 2 + mpt), D ** -0.5, rule=rule,
                                       launch=launch)
        torch.testing.assert_close(out.cpu(), plain.cpu(), rtol=0, atol=1e-5, msg=lambda m: f"{chunks, rule}: {m}")


def test_cascade_suffix_launch_takes_the_small_batch_tile_up_to_its_row_count():
    """The suffix launch per batch bucket: at most ``small_batch_rows`` rows -> the small tile;
    more rows (or no batch size) -> ``DECODE_LAUNCH``'s; explicit ``suffix_*`` win at any size."""
    from asyncrl.engine.triton_decode import DECODE_LAUNCH, cascade_suffix_launch

    rule = CascadeLaunchRule()
    small = cascade_suffix_launch(rule, DECODE_LAUNCH, batch_rows=128)
    assert (small.block_n, small.num_warps) == (rule.small_suffix_block_n, rule.small_suffix_warps) == (16, 2)
    for rows in (129, 512, None):
        big = cascade_suffix_launch(rule, DECODE_LAUNCH, batch_rows=rows)
        assert (big.block_n, big.num_warps) == (DECODE_LAUNCH.block_n, DECODE_LAUNCH.num_warps)
    pinned = cascade_suffix_launch(CascadeLaunchRule(suffix_block_n=32), DECODE_LAUNCH, batch_rows=8)
    assert (pinned.block_n, pinned.num_warps) == (32, 2)
    off = cascade_suffix_launch(CascadeLaunchRule(small_batch_rows=0), DECODE_LAUNCH, batch_rows=8)
    assert off == DECODE_LAUNCH


def test_cascade_prefetch_follows_the_rule_and_the_cache_dtype(monkeypatch):
    """The suffix decode prefetches block ids on e4m3 caches by default (level 1), at every batch
    size and never on bf16 (not even full grids, unlike the plain decode); level 2 = every cache, 0 =
    off; a pinned launch is kept. The prefix kernel prefetches on every cache by default, only where a
    tile lies in one block."""
    from asyncrl.engine import triton_decode as td

    monkeypatch.setattr(td, "num_sms", lambda device: 4)
    bf16 = torch.zeros(2, 64, 2, 8, dtype=torch.bfloat16)
    fp8 = bf16.to(torch.float8_e4m3fn)
    full = 16  # 8 programs per SM at 2 kv heads
    rule = CascadeLaunchRule()
    for rows in (8, full, None):
        assert td.cascade_suffix_launch(rule, batch_rows=rows, k_cache=fp8).table_prefetch
        assert not td.cascade_suffix_launch(rule, batch_rows=rows, k_cache=bf16).table_prefetch
    wide = td.cascade_suffix_launch(CascadeLaunchRule(small_batch_rows=0, suffix_prefetch=2), batch_rows=full,
                                    k_cache=bf16)
    assert wide == dataclasses.replace(td.DECODE_LAUNCH, table_prefetch=True)
    assert not td.cascade_suffix_launch(CascadeLaunchRule(suffix_prefetch=0), batch_rows=8, k_cache=fp8).table_prefetch
    assert not td.cascade_suffix_launch(rule, batch_rows=8).table_prefetch  # no cache named: DECODE_LAUNCH's
    monkeypatch.setattr(td, "_LAUNCH_PINNED", True)
    assert not td.cascade_suffix_launch(rule, batch_rows=8, k_cache=fp8).table_prefetch
    assert td.prefix_prefetch(rule, 64, fp8) and td.prefix_prefetch(rule, 64, bf16)
    assert td.prefix_prefetch(CascadeLaunchRule(prefix_prefetch=1), 64, fp8)
    assert not td.prefix_prefetch(CascadeLaunchRule(prefix_prefetch=1), 64, bf16)
    assert not td.prefix_prefetch(CascadeLaunchRule(prefix_prefetch=0), 64, fp8)
    assert not td.prefix_prefetch(CascadeLaunchRule(prefix_block_n=64), 16, bf16)  # a tile spans blocks


# (prefix chunks in the plan header, suffix split-KV, cache dtype): the concurrent cascade's kernels
CONCURRENT_CASES = [(1, 1, torch.float32), (2, 1, torch.float32), (1, 1, torch.bfloat16), (2, 1, torch.bfloat16),
                    (2, 2, torch.float32)]


@pytest.mark.skipif(CUDA, reason="4-token tiles keep the interpreter run small; test_gpu.py runs the concurrent "
                                  "cascade at real tile sizes, eager and under a CUDA graph")
@pytest.mark.parametrize("chunks,kv_splits,cache_dtype", CONCURRENT_CASES)
def test_concurrent_cascade_matches_serialized_and_float64(chunks, kv_splits, cache_dtype):
    """``CascadeLaunchRule.concurrent_prefix``: the suffix kernel without the prefix merge (its own
    keys only, as partials) and the merge kernel give the serialized cascade's output (to fp32
    rounding) and the float64 reference's, for rows in groups (a prefix of 1 to 6 blocks, 1 or 2
    chunks, one chunk empty for the 1-block prefix) and rows outside any (a singleton, whose
    whole context is its suffix), with the suffix split into 1 or 2 chunks."""
    import numpy as np
    from test_cascade import _pad, _tables

    from asyncrl.engine.cascade import cascade_attention_reference, plan_cascade, tile_shape
    from asyncrl.engine.triton_decode import (cascade_decode_attention, launch_prefix, launch_suffix_partials,
                                              merge_cascade)

    H, Hkv, D, page = 4, 2, 16, 4
    groups, prefix = [3, 1, 2, 2], [4, 3, 1, 6]
    g = torch.Generator().manual_seed(5 + chunks)
    suffix = torch.randint(1, 4 * page, (sum(groups),), generator=g).tolist()
    suffix[0] = 1  # the current token only
    tables, ctx, nb = _tables(groups, page, prefix, suffix, seed=5)
    kc, vc = (torch.randn(nb + 1, page, Hkv, D, generator=g).to(cache_dtype) for _ in range(2))
    B = len(tables)
    q = torch.randn(B, H, D, generator=g)
    bt_np, ctx_np = _pad(tables, max(len(t) for t in tables) + 1, nb), np.asarray(ctx, dtype=np.int32)
    _, mpt = tile_shape(H // Hkv)
    plan = plan_cascade(bt_np, ctx_np, page, mpt, bs=B, min_saved_fraction=0.0)
    plan.prefix_splits = chunks
    assert (plan.suffix_start == 0).sum() == 1 and plan.num_tiles == 3  # the singleton is outside any group
    packed = torch.from_numpy(plan.packed()).to(DEVICE)
    sfx, tiles = packed[:B], packed[B:].view(-1, 2 + mpt)
    dev = [t.to(DEVICE) for t in (q, kc, vc, torch.from_numpy(bt_np), torch.from_numpy(ctx_np))]
    rule = CascadeLaunchRule(prefix_fill=1, max_prefix_splits=2, prefix_block_n=4, suffix_kv_splits=kv_splits,
                             suffix_block_n=4)
    serial = cascade_decode_attention(*dev, sfx, tiles, D ** -0.5, rule=rule)
    concurrent = cascade_decode_attention(*dev, sfx, tiles, D ** -0.5,
                                          rule=dataclasses.replace(rule, concurrent_prefix=1))
    ref = cascade_attention_reference(q.double(), kc.double(), vc.double(), tables, ctx, plan, D ** -0.5)
    torch.testing.assert_close(concurrent.cpu(), serial.cpu(), rtol=0, atol=2e-6)
    torch.testing.assert_close(concurrent.cpu().double(), ref, rtol=0, atol=1e-5)
    # the pieces: the suffix partials hold only each row's own keys (a grouped row's alone is not the answer)
    so, sl = launch_suffix_partials(*dev, sfx, D ** -0.5, rule)
    assert so.shape == (kv_splits, B, H, D) and sl.shape == (kv_splits, B, H)
    assert torch.isfinite(sl[0]).all()  # chunk 0 holds the current token
    lone = int(np.flatnonzero(plan.suffix_start == 0)[0])
    if kv_splits == 1:
        torch.testing.assert_close(so[0, lone].cpu().double(), ref[lone], rtol=0, atol=1e-5)
        assert (so[0, 0].cpu().double() - ref[0]).abs().max() > 1e-3
    prefix = launch_prefix(dev[0], dev[1], dev[2], dev[3], tiles, D ** -0.5, rule)
    out = merge_cascade(prefix, (so, sl), sfx, tiles, torch.empty_like(dev[0]))
    torch.testing.assert_close(out.cpu(), concurrent.cpu(), rtol=0, atol=0)
