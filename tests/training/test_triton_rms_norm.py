"""The trainer's RMSNorm backward kernel (triton_rms_norm.py) against float64 autograd of HF's formula.

On a CUDA machine these run on the GPU (bf16 against Liger's own backward included); on a CPU
through the Triton interpreter when asked for (``TRITON_INTERPRET=1`` and triton installed), else skip.
"""
import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if importlib.util.find_spec("triton") is None or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 with triton installed", allow_module_level=True)

from asyncrl.training.triton_rms_norm import rms_norm_backward  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6


def _hf_rms_norm(x, w):
    """HF's Qwen3RMSNorm: inverse RMS in fp32, w * normalized (in the input dtype)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return w * (x.float() * torch.rsqrt(variance + EPS)).to(x.dtype)


@pytest.mark.parametrize("rows,cols", [(1, 16), (37, 100), (300, 128), (9, 1024)])
@pytest.mark.parametrize("programs_per_sm", [1, 8])
def test_backward_matches_float64_autograd(rows, cols, programs_per_sm):
    """fp32: dx and dw equal float64 autograd of HF's formula; (300, 128) with one program per SM
    makes programs stride over several row tiles (10 tiles of 32 rows, 8 "SMs" off CUDA), (37, 100)
    has ragged rows and columns."""
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g).to(DEVICE)
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(DEVICE)
    dy = torch.randn(rows, cols, generator=g).to(DEVICE)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    dx, dw = rms_norm_backward(dy, x, w, rstd, programs_per_sm=programs_per_sm)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    _hf_rms_norm(xd, wd).backward(dy.double())
    torch.testing.assert_close(dx.double(), xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), wd.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not CUDA or importlib.util.find_spec("liger_kernel") is None, reason="needs CUDA and Liger")
@pytest.mark.parametrize("shape", [(4096, 1024), (2, 2048, 16, 128), (1, 300, 8, 128)])
def test_wide_backward_matches_liger_on_gpu(shape):
    """bf16 on the GPU: the Function with this backward gives Liger's forward and, within bf16
    rounding of a different summation order, Liger's gradients."""
    from liger_kernel.ops import LigerRMSNormFunction

    from asyncrl.training.triton_rms_norm import wide_rms_norm_function

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=g, dtype=torch.bfloat16)
    dy = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
    outs = []
    for function in (LigerRMSNormFunction, wide_rms_norm_function()):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = function.apply(xi, wi, EPS, 0.0, "llama", False)
        y.backward(dy.clone())
        outs.append((y.float(), xi.grad.float(), wi.grad.float()))
    (y0, dx0, dw0), (y1, dx1, dw1) = outs
    assert torch.equal(y0, y1)
    torch.testing.assert_close(dx1, dx0, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw1, dw0, rtol=2e-2, atol=2e-2 * dw0.abs().max().item())
