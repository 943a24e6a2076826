"""``triton_decode.paged_decode_fused``: the decode kernel that makes q and the new token's K/V from the qkv
GEMM's row itself (q/k RMSNorm, RoPE, the cache write) against the two kernels it replaces,
``triton_qkv.qkv_to_cache`` then ``paged_decode_attention``, on the same inputs.

On a GPU it runs natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) through the Triton
interpreter; otherwise the module is skipped.
"""

import pytest
import torch
from conftest import scattered_tables, skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from asyncrl.engine.attention import FP8_KV  # noqa: E402
from asyncrl.engine.triton_decode import (DecodeLaunch, FusedQKV, fuses_qkv, paged_decode_attention,  # noqa: E402
                                          paged_decode_fused)
from asyncrl.engine.triton_qkv import qkv_to_cache  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
# the model dtype of the bf16-cache cases: the interpreter's bf16 ``tl.dot`` returns garbage (numpy has no bf16),
# so on CPU those run in fp32 (IEEE dots); e4m3 caches take bf16 queries into fp16 dots on both
MODEL_DTYPE = torch.bfloat16 if CUDA else torch.float32


@pytest.fixture(autouse=True)
def _interpreter_index_on_numpy_2(monkeypatch):
    """As in test_triton_decode.py: the interpreter's loop bounds from loaded scalars under numpy >= 2.3."""
    if CUDA:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


def _step(lens: list[int], H: int, Hkv: int, D: int, page: int, dtype, cache_dtype, norm: bool, seed: int):
    """One decode step's inputs: qkv ``[B, (H + 2 Hkv) D]`` in ``dtype``, caches with random keys (the new tokens' slots
    too, so a kernel that read a slot before writing it would be caught), block tables, context lengths, the new
    tokens' positions (ctx - 1) and slots, RoPE tables and q/k norm weights."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // page) for n in lens) + 2
    kc = torch.randn(nb + 1, page, Hkv, D, generator=g).to(cache_dtype)
    vc = torch.randn(nb + 1, page, Hkv, D, generator=g).to(cache_dtype)
    tables, bt = scattered_tables(lens, page, nb, g)
    pos = torch.tensor(lens) - 1
    slots = torch.tensor([t[p // page] * page + p % page for t, p in zip(tables, pos.tolist())])
    qkv = (torch.randn(len(lens), (H + 2 * Hkv) * D, generator=g) * 2).to(dtype)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    freqs = torch.outer(torch.arange(4 * page * 8).float(), inv)
    emb = torch.cat((freqs, freqs), -1)
    qw = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype) if norm else None
    kw = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype) if norm else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return dict(qkv=to(qkv), kc=to(kc), vc=to(vc), bt=to(bt), lens=to(torch.tensor(lens, dtype=torch.int32)),
                pos=to(pos), slots=to(slots), cos=to(emb.cos()), sin=to(emb.sin()), qw=to(qw), kw=to(kw))


@pytest.mark.parametrize("launch_kw,fp8,norm", [
    (dict(), False, True),
    (dict(block_n=16, num_warps=1, table_prefetch=True, longest_first=True, tiled_loads=True, lazy_rescale=True),
     False, True),
    (dict(block_n=16, num_warps=1, table_prefetch=True, longest_first=True, tiled_loads=True, lazy_rescale=True),
     True, True),
    (dict(block_n=16, kv_splits=2), False, False),
    (dict(block_n=16, kv_splits=4, tiled_loads=True), True, True)])
def test_fused_decode_equals_qkv_write_then_attention(launch_kw, fp8, norm):
    """Sequences whose new token is the first of a block, the last of one, mid-block, and alone (a padding row's
    context of 1, whose only key is the new one; split-KV chunks with no cached key); GQA 2; bf16 and e4m3 caches;
    with and without Qwen3's q/k norm; tiled loads, the lazy rescale, split-KV. The caches the fused kernel writes
    equal the two kernels' (the new K/V at their slots, nothing else touched), and the attention agrees to the
    ulps of the new key's score (an fp32 sum there, the dot's accumulation in the reference)."""
    H, Hkv, D, page = 4, 2, 32, 16
    lens = [1, page + 1, 2 * page, 3 * page + 5, 2]
    dtype = torch.bfloat16 if fp8 else MODEL_DTYPE
    s = _step(lens, H, Hkv, D, page, dtype, FP8_KV if fp8 else dtype, norm, seed=len(launch_kw) + fp8)
    launch = DecodeLaunch(**launch_kw)
    assert fuses_qkv(launch, D, s["kc"], s["vc"])
    kc_ref, vc_ref = s["kc"].clone(), s["vc"].clone()
    q = qkv_to_cache(s["qkv"], s["pos"], s["cos"], s["sin"], s["qw"], s["kw"], 1e-6, H, Hkv, D, kc_ref, vc_ref,
                     s["slots"])
    ref = paged_decode_attention(q, kc_ref, vc_ref, s["bt"], s["lens"], D ** -0.5, launch=launch)
    fused = FusedQKV(s["qkv"], s["pos"], s["cos"], s["sin"], s["qw"], s["kw"], 1e-6, s["slots"])
    out = paged_decode_fused(fused, H, D, s["kc"], s["vc"], s["bt"], s["lens"], D ** -0.5, launch=launch)
    torch.testing.assert_close(s["kc"].float(), kc_ref.float(), rtol=0, atol=0)
    torch.testing.assert_close(s["vc"].float(), vc_ref.float(), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2e-3)


def test_unfusable_launch_takes_the_two_kernels():
    """A launch the fused kernel does not serve (the packed-heads kernel) or a head dim that is not a power of two:
    ``paged_decode_fused`` runs ``qkv_to_cache`` and the attention instead, with the same results."""
    H, Hkv, D, page = 4, 2, 32, 16
    packed = DecodeLaunch(16, 4, 2, variant="packed", fp8_block_n=16)
    s = _step([3, page + 2], H, Hkv, D, page, MODEL_DTYPE, MODEL_DTYPE, True, seed=7)
    assert not fuses_qkv(packed, D, s["kc"], s["vc"])
    assert not fuses_qkv(DecodeLaunch(), 48, s["kc"], s["vc"])
    kc_ref, vc_ref = s["kc"].clone(), s["vc"].clone()
    q = qkv_to_cache(s["qkv"], s["pos"], s["cos"], s["sin"], s["qw"], s["kw"], 1e-6, H, Hkv, D, kc_ref, vc_ref,
                     s["slots"])
    ref = paged_decode_attention(q, kc_ref, vc_ref, s["bt"], s["lens"], D ** -0.5, launch=packed)
    fused = FusedQKV(s["qkv"], s["pos"], s["cos"], s["sin"], s["qw"], s["kw"], 1e-6, s["slots"])
    out = paged_decode_fused(fused, H, D, s["kc"], s["vc"], s["bt"], s["lens"], D ** -0.5, launch=packed)
    torch.testing.assert_close(s["kc"].float(), kc_ref.float(), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=0)
