"""FP8 blockwise quantization (engine/fp8.py): hand-derived values, per-element error bounds, and
the W8A8 reference matmul against a float64 product within the bound those errors imply.

e4m3fn (1 sign, 4 exponent, 3 mantissa bits): between 2^e and 2^(e+1) the spacing is 2^(e-3), so
rounding a normal value moves it by at most half a spacing, |v| * 2^-4; below 2^-6 (subnormal) the
spacing is 2^-9, so by at most 2^-10. Values are divided by the block's scale first, hence the
bound per element: |w - deq(q(w))| <= max(|w| * 2^-4, scale * 2^-10).
"""
import pytest
import torch

from asyncrl.engine.fp8 import (BLOCK, FP8_MAX, dequantize_tokens, dequantize_weight, fp8_matmul_reference,
                                padded_k, quantize_tokens, quantize_weight)


def element_bound(values: torch.Tensor, scale_per_element: torch.Tensor) -> torch.Tensor:
    return torch.maximum(values.abs() * 2.0 ** -4, scale_per_element * 2.0 ** -10)


def assert_within_the_product_bound(y, x, w, ex, ew) -> float:
    """|y - x Wᵀ| <= Σ_k (|x_k| + e_x)(|w_k| + e_w) - |x_k||w_k| (+ fp32 accumulation, + the bf16 rounding
    of the output when ``y`` is bf16) against a float64 product; returns the relative Frobenius error."""
    exact = x.double() @ w.double().t()
    ax, aw = x.double().abs(), w.double().abs()
    bound = (ax + ex) @ (aw + ew).t() - ax @ aw.t() + 1e-5 * (ax @ aw.t())
    if y.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0 ** -8 + (bound * 2.0 ** -8)
    err = (y.double() - exact).abs()
    assert (err <= bound).all()
    return (err.norm() / exact.norm()).item()


def test_hand_checked_blocks():
    """A 256 x 256 weight = 2 x 2 blocks (K padded to 512: 2 more all-zero block columns)."""
    w = torch.ones(256, 256)
    w[0, 0], w[1, 1], w[2, 2] = 448.0, 3.3, -100.0            # block (0, 0): amax 448 -> scale 1 exactly
    w[:128, 128:] = 0.0                                        # block (0, 1): all zero
    w[128:, :128] = w[:128, :128] * 2.0 ** -20                 # block (1, 0): block (0, 0) scaled by 2^-20
    w[128:, 128:] = 1.0
    w[128, 128] = 1000.0                                       # block (1, 1): scale 1000/448
    q, scale = quantize_weight(w, padded_k(256))
    assert q.shape == (256, 512) and scale.shape == (2, 4)
    assert scale[0, 0] == 1.0 and scale[1, 0] == 2.0 ** -20
    assert torch.isclose(scale[1, 1], torch.tensor(1000.0 / 448))
    assert torch.equal(scale[:, 2:], torch.full((2, 2), 1e-12 / FP8_MAX))  # padding blocks: the amax floor, no NaN
    deq = dequantize_weight(q, scale)
    assert deq[0, 0] == 448.0 and deq[0, 5] == 1.0             # representable values come back exactly
    assert deq[1, 1] == 3.25                                    # 3.3: spacing 0.25 in [2, 4) -> 3.25 (error 0.05)
    assert deq[2, 2] == -96.0                                   # -100: halfway between -96 and -104 -> even mantissa
    assert torch.equal(deq[:128, 128:256], torch.zeros(128, 128))  # zero block stays zero
    assert torch.equal(deq[128:, :128], deq[:128, :128] * 2.0 ** -20)  # scale-invariant
    # block (1, 1): 1.0 / (1000/448) = 0.448 -> spacing 2^-5 in [0.25, 0.5): 0.4375; back: 0.4375 * 1000/448
    assert torch.isclose(deq[129, 129], torch.tensor(0.4375 * 1000 / 448))
    assert torch.isclose(deq[128, 128], torch.tensor(1000.0))
    assert torch.equal(deq[:, 256:], torch.zeros(256, 256))


def test_weight_round_trip_within_the_per_element_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 700, generator=g)
    w *= torch.exp(3 * torch.randn(3, 1, 6, 1, generator=g)).expand(3, 128, 6, 128).reshape(384, 768)[:300, :700]
    q, scale = quantize_weight(w, padded_k(700))
    deq = dequantize_weight(q, scale)[:300, :700]
    per_element = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:300, :700]
    err = (deq - w).abs()
    assert (err <= element_bound(w, per_element) * (1 + 1e-6)).all()
    assert err.max() > 0
    for rb in range(3):  # each block's largest magnitude maps to +-448 and comes back (fp32 rounding only)
        for kb in range(6):
            block = (slice(rb * BLOCK, (rb + 1) * BLOCK), slice(kb * BLOCK, (kb + 1) * BLOCK))
            torch.testing.assert_close(deq[block].abs().max(), w[block].abs().max(), rtol=1e-6, atol=0)
    assert torch.equal(q[300:].float(), torch.zeros(84, 1024)) and torch.equal(q[:, 700:].float(), torch.zeros(384, 324))


def test_token_groups_round_trip_and_rows_are_independent():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 300, generator=g) * torch.tensor([1e-3, 1, 10, 100, 1, 1, 1])[:, None]
    q, scale = quantize_tokens(x, padded_k(300))
    assert q.shape == (7, 512) and scale.shape == (7, 4)
    deq = dequantize_tokens(q, scale)[:, :300]
    per_element = scale.repeat_interleave(BLOCK, 1)[:, :300]
    assert ((deq - x).abs() <= element_bound(x, per_element) * (1 + 1e-6)).all()
    for i in range(7):  # a token's quantization does not depend on its batch (batch-invariant rollouts)
        qi, si = quantize_tokens(x[i:i + 1], padded_k(300))
        assert torch.equal(qi.view(torch.uint8), q[i:i + 1].view(torch.uint8)) and torch.equal(si, scale[i:i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matmul_within_the_fp8_error_of_the_exact_product(dtype):
    """|y_fp8 - x Wᵀ| <= Σ_k (|x_k| + e_x)(|w_k| + e_w) - |x_k||w_k|, with e_x, e_w the per-element
    bounds above (and the bf16 rounding of the output), checked against a float64 product."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 700, generator=g).to(dtype)
    w = (torch.randn(300, 700, generator=g) * 0.05).to(dtype)
    wq, ws = quantize_weight(w, padded_k(700))
    y = fp8_matmul_reference(x, wq, ws)
    assert y.dtype == dtype and y.shape == (5, 384)
    _, xs = quantize_tokens(x, padded_k(700))
    ex = element_bound(x.double(), xs.double().repeat_interleave(BLOCK, 1)[:, :700])
    ew = element_bound(w.double(), ws.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:300, :700])
    relative = assert_within_the_product_bound(y[:, :300], x, w, ex, ew)
    assert 1e-3 < relative < 0.1  # FP8 moves the product (not exact), by a few percent at most
    assert torch.equal(y[:, 300:].float(), torch.zeros(5, 84))  # padded output rows


def test_a_gpu_without_fp8_is_refused_by_name(monkeypatch):
    from asyncrl.engine.fp8 import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a GPU of compute capability 9.0\+; NVIDIA A100 is 8.0"):
        check_fp8_device(torch.device("cuda", 0), "quantization='fp8'", (9, 0))
    check_fp8_device(torch.device("cpu"), "quantization='fp8'", (9, 0))  # CPU: the reference path
