"""FP8 per-channel weights x per-token activations (engine/fp8_channel.py): hand-derived values, the
per-element error bound, the reference matmul against a float64 product, and the fast path's wiring
(``torch._scaled_mm`` rowwise, which PyTorch also runs on CPU) against the reference.

Bound per element (test_fp8.py derives it): |v - deq(q(v))| <= max(|v| 2^-4, scale 2^-10), here with
one scale per row instead of per 128 x 128 block.
"""
import importlib.util
import os

import pytest
import torch

from asyncrl.engine.fp8 import FP8_MAX
from asyncrl.engine.fp8_channel import (dequantize_rows, matmul_reference, matmul_scaled_mm, padded_k,
                                        quantize_rows)

from test_fp8 import assert_within_the_product_bound, element_bound


def test_hand_checked_rows():
    """Four rows of 40 channels (K padded to 48): amax 448 -> scale 1; all zero; row 0 times 2^-20;
    amax 1000."""
    w = torch.ones(4, 40)
    w[0, 0], w[0, 1], w[0, 2] = 448.0, 3.3, -100.0
    w[1] = 0.0
    w[2] = w[0] * 2.0 ** -20
    w[3, 0] = 1000.0
    q, scale = quantize_rows(w, padded_k(40))
    assert q.shape == (4, 48) and q.dtype == torch.float8_e4m3fn and scale.shape == (4, 1)
    assert scale[0, 0] == 1.0 and scale[2, 0] == 2.0 ** -20
    assert scale[1, 0] == torch.tensor(1e-12) / FP8_MAX                 # the amax floor: zeros, no NaN
    assert torch.isclose(scale[3, 0], torch.tensor(1000.0 / 448))
    deq = dequantize_rows(q, scale)
    assert deq[0, 0] == 448.0 and deq[0, 3] == 1.0                      # representable: exact
    assert deq[0, 1] == 3.25                                             # spacing 0.25 in [2, 4)
    assert deq[0, 2] == -96.0                                            # halfway -96 / -104: even mantissa
    assert torch.equal(deq[1], torch.zeros(48))
    assert torch.equal(deq[2], deq[0] * 2.0 ** -20)                      # scale-invariant
    assert torch.isclose(deq[3, 1], torch.tensor(0.4375 * 1000 / 448))   # 0.448 -> 0.4375 (spacing 2^-5)
    assert torch.equal(q[:, 40:].float(), torch.zeros(4, 8))             # padding columns


def test_round_trip_within_the_per_element_bound_and_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=g) * torch.logspace(-4, 3, 9)[:, None]
    q, scale = quantize_rows(x, padded_k(300))
    deq = dequantize_rows(q, scale)[:, :300]
    err = (deq - x).abs()
    assert (err <= element_bound(x, scale.expand(-1, 300)) * (1 + 1e-6)).all() and err.max() > 0
    torch.testing.assert_close(deq.abs().amax(1), x.abs().amax(1), rtol=1e-6, atol=0)  # each row's amax -> 448 -> back
    for i in range(9):  # a token's quantization does not depend on its batch (batch-invariant rollouts)
        qi, si = quantize_rows(x[i:i + 1], padded_k(300))
        assert torch.equal(qi.view(torch.uint8), q[i:i + 1].view(torch.uint8)) and torch.equal(si, scale[i:i + 1])


def test_an_outlier_coarsens_its_row_only():
    """One scale per row: an outlier of 1000 in row 0 (scale 1000/448) puts its 0.01s at 0.00448 in
    scaled units, among e4m3's subnormals (spacing 2^-9): 0.00448 / 2^-9 = 2.29 -> 2, so they come back
    as 2^-8 * 1000/448 = 0.00872 (13% off), while row 1 (no outlier) keeps e4m3's relative 2^-4."""
    x = torch.full((2, 64), 0.01)
    x[0, 0] = 1000.0
    deq = dequantize_rows(*quantize_rows(x, padded_k(64)))
    assert abs(deq[1, 5].item() - 0.01) <= 0.01 * 2 ** -4
    assert deq[0, 5].item() == pytest.approx(2.0 ** -8 * 1000 / 448, rel=1e-6)
    assert deq[0, 0].item() == pytest.approx(1000.0, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matmul_within_the_fp8_error_of_the_exact_product(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 700, generator=g).to(dtype)
    w = (torch.randn(300, 700, generator=g) * 0.05).to(dtype)
    wq, ws = quantize_rows(w, padded_k(700))
    y = matmul_reference(x, wq, ws)
    assert y.dtype == dtype and y.shape == (5, 300)
    _, xs = quantize_rows(x, padded_k(700))
    ex, ew = element_bound(x.double(), xs.double()), element_bound(w.double(), ws.double())
    assert 1e-3 < assert_within_the_product_bound(y, x, w, ex, ew) < 0.1


TRITON = importlib.util.find_spec("triton") is not None and (torch.cuda.is_available()
                                                             or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.skipif(not TRITON, reason="needs CUDA, or TRITON_INTERPRET=1 with triton installed")
def test_scaled_mm_path_equals_the_reference():
    """The fast path's wiring (Triton per-token quantization, ``_scaled_mm`` with ``scale_a [M, 1]``,
    ``scale_b = Wsᵀ [1, N]``): on the same e4m3 inputs it equals the reference within 2 bf16 ulps."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(208, 700, generator=g) * 0.02).to(torch.bfloat16).to(device)
    wq, ws = quantize_rows(w, padded_k(700))
    for m in (1, 5, 33):
        x = torch.randn(m, 700, generator=g).to(torch.bfloat16).to(device)
        fast, ref = matmul_scaled_mm(x, wq, ws), matmul_reference(x, wq, ws)
        assert fast.shape == ref.shape == (m, 208) and fast.dtype == torch.bfloat16
        torch.testing.assert_close(fast.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * ref.float().abs().mean().item())
