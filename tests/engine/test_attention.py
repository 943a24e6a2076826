"""The gathered path's packed (varlen) metadata and attention: hand-derived host arrays; on CPU the
packing checked through a float64 stand-in for FlashAttention-2's varlen kernel; on a GPU the real
kernel (causal from the bottom right) against the padded, masked SDPA path."""
import pytest
import torch
from conftest import scattered_tables

from asyncrl.engine import attention
from asyncrl.engine.attention import FP8_KV, build_gathered_metadata, gathered_attention, gathered_host_arrays


def test_packed_host_arrays_by_hand():
    """Sequence 0 has 3 cached tokens and computes 2 (positions 3, 4); sequence 1 is a fresh prompt of 4;
    pages of 4 tokens, sequence 0 in blocks [5, 2], sequence 1 in block [7]."""
    host = gathered_host_arrays([[5, 2], [7]], [3, 0], [2, 4], block_size=4, scratch_block=9)
    assert host.cu_q.tolist() == [0, 2, 6] and host.cu_k.tolist() == [0, 5, 9]
    assert host.cu_q.dtype == host.cu_k.dtype == "int32"
    # keys 0..4 of sequence 0 (block 5 slots 20-23, then block 2 slot 8), keys 0..3 of sequence 1 (block 7)
    assert host.kv_packed.tolist() == [20, 21, 22, 23, 8, 28, 29, 30, 31]
    assert (host.shape.causal, host.shape.max_q, host.shape.max_k) == (False, 4, 5)
    assert gathered_host_arrays([[1], [2]], [0, 0], [3, 3], 4, 9).shape.causal


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """FlashAttention-2's varlen semantics in float64: per sequence, query i of n sees keys < m - n + i + 1."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        n, m = len(qs), len(ks)
        assert n <= max_q and m <= max_k
        rep = q.shape[1] // k.shape[1]
        kr, vr = (t.double().repeat_interleave(rep, 1).transpose(0, 1) for t in (ks, vs))
        s = qs.double().transpose(0, 1) @ kr.transpose(1, 2) * scale  # [H, n, m]
        allowed = torch.arange(m)[None, :] < torch.arange(n)[:, None] + (m - n) + 1
        p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[cu_q[b]:cu_q[b + 1]] = (p @ vr).transpose(0, 1)
    return out.to(q.dtype)


def _step(H, Hkv, D, page, starts, news, dtype, device, seed=0):
    """A gathered step over scattered blocks: (q [T, H, D], k_cache, v_cache, meta)."""
    g = torch.Generator().manual_seed(seed)
    ctx = [s + n for s, n in zip(starts, news)]
    nb = sum(-(-c // page) for c in ctx) + 1
    tables, _ = scattered_tables(ctx, page, nb, g)
    kc, vc = (torch.randn(nb + 1, page, Hkv, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(sum(news), H, D, generator=g).to(dtype)
    meta = build_gathered_metadata(tables, starts, news, page, nb, device)
    return q.to(device), kc.to(device), vc.to(device), meta


CASES = [(4, 2, 16, 4, [3, 0, 9], [2, 5, 1]), (8, 8, 16, 8, [0, 0], [7, 3]), (4, 1, 8, 4, [0], [6])]


@pytest.mark.parametrize("H,Hkv,D,page,starts,news", CASES)
def test_varlen_packing_equals_the_padded_path(H, Hkv, D, page, starts, news, monkeypatch):
    """Chunks after cached prefixes, fresh prompts of unequal length, GQA and MQA: the varlen path's packed
    queries and keys through the float64 stand-in give the padded, masked path's attention."""
    q, kc, vc, meta = _step(H, Hkv, D, page, starts, news, torch.float32, torch.device("cpu"))
    padded = gathered_attention(q, kc, vc, meta, D ** -0.5)
    monkeypatch.setattr(attention, "takes_varlen", lambda q, meta: True)
    monkeypatch.setattr(attention, "flash_varlen_causal", reference_varlen)
    packed = gathered_attention(q, kc, vc, meta, D ** -0.5)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)


def test_varlen_only_on_cuda_in_half_precision_on_sm80_and_later(monkeypatch):
    q, kc, vc, meta = _step(4, 2, 16, 4, [0], [3], torch.float32, torch.device("cpu"))
    assert not attention.takes_varlen(q, meta) and not attention.takes_varlen(q.bfloat16(), meta)
    for capability, capable in (((7, 5), False), ((8, 0), True), ((9, 0), True)):  # T4; A100; H100/H200
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        attention._flash_capable.cache_clear()
        assert attention._flash_capable(0) is capable
    attention._flash_capable.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("H,Hkv,D,page,starts,news", CASES + [(16, 8, 128, 64, [0, 0, 130, 0], [700, 100, 64, 1024])])
def test_flash_varlen_equals_the_padded_path_on_gpu(H, Hkv, D, page, starts, news, fp8, monkeypatch):
    """The real kernel (bf16; an e4m3 cache upcast by the gather): the padded path's attention within bf16
    rounding, so its causal alignment for chunks after a cached prefix is the bottom-right one."""
    q, kc, vc, meta = _step(H, Hkv, D, page, starts, news, torch.bfloat16, torch.device("cuda"))
    if fp8:
        kc, vc = kc.to(FP8_KV), vc.to(FP8_KV)
    assert attention.takes_varlen(q, meta)
    packed = gathered_attention(q, kc, vc, meta, D ** -0.5)
    monkeypatch.setattr(attention, "VARLEN_PREFILL", False)
    padded = gathered_attention(q, kc, vc, meta, D ** -0.5)
    torch.testing.assert_close(packed.float(), padded.float(), rtol=2e-2, atol=2e-2)
