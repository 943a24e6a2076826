"""The Triton FP8 activation quantization (engine/triton_fp8.py) equals the torch references: the
blockwise layout (per token per 128 channels, rows padded to 4, scales M-major) and the per-token
one. On a GPU natively; on CPU through the Triton interpreter (``TRITON_INTERPRET=1``, triton
installed), else skipped. The kernel rounds to e4m3's grid in fp32 before its cast, so the
interpreter's own (truncating) fp32 -> e4m3 conversion cannot change a value: the e4m3 bytes are
compared (a tiny negative value must become -0, as torch's cast makes it)."""
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None or not (torch.cuda.is_available()
                                                      or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 with triton installed", allow_module_level=True)

from asyncrl.engine import fp8, fp8_channel  # noqa: E402
from asyncrl.engine.triton_fp8 import quantize_rows_cuda, quantize_tokens_cuda  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows_of(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 rows spanning 5 decades, an all-zero 128-group and the rounding cases of test_fp8.py."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    x[0, :128] = 0
    x[-1, :4] = torch.tensor([448.0, 3.3, -100.0, 124.3])   # amax 448: scale 1; 3.3 -> 3.25; tie -> -96; carry -> 128
    x[-1, 4:6] = torch.tensor([-1e-6, -0.0])                  # both -> -0 (byte 0x80)
    return x.to(torch.bfloat16).to(DEVICE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("m,k", [(1, 64), (6, 700), (37, 3072)])
def test_per_token_rows_equal_torch(m, k):
    x = rows_of(m, k, seed=k)
    q, scale = fp8_channel.quantize_rows(x, fp8_channel.padded_k(k))
    q_t, scale_t = quantize_rows_cuda(x, fp8_channel.padded_k(k))
    assert q_t.shape == q.shape and scale_t.shape == (m, 1)
    assert torch.equal(scale_t, scale)
    assert same_bytes(q_t, q)
    assert q_t[-1, :4].float().tolist() == [448.0, 3.25, -96.0, 128.0]
    assert q_t[-1, 4:6].view(torch.uint8).tolist() == [0x80, 0x80]


@pytest.mark.parametrize("m,k", [(1, 64), (6, 700), (37, 3072)])
def test_token_groups_equal_torch(m, k):
    x = rows_of(m, k, seed=k + 1)
    q, scale = fp8.quantize_tokens(x, fp8.padded_k(k))
    q_t, scale_t = quantize_tokens_cuda(x, fp8.padded_k(k))
    mp = -(-m // 4) * 4
    assert q_t.shape == (mp, fp8.padded_k(k)) and scale_t.shape == (fp8.padded_k(k) // 128, mp)
    assert torch.equal(scale_t.t()[:m], scale)
    assert same_bytes(q_t[:m], q)
    assert not q_t[m:].view(torch.uint8).any()                               # padding rows: +0
    assert q_t[-1 if m % 4 == 0 else m - 1, :4].float().tolist() == [448.0, 3.25, -96.0, 128.0]
