"""The Triton row kernels of the fused LM head against float64 autograd.

On a CUDA machine these run on the GPU (bf16 included); on a CPU they run through the Triton
interpreter when it is asked for (``TRITON_INTERPRET=1`` and triton installed), else skip.
"""
import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if importlib.util.find_spec("triton") is None or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 with triton installed", allow_module_level=True)

from asyncrl.training.head_logprobs import linear_logprobs  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def _reference(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden.double() @ weight.double().T) / temperature, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy_grad", [False, True])
def test_triton_rows_match_float64_autograd(temperature, with_entropy_grad):
    """fp32 inputs, a vocabulary over two kernel blocks with a ragged tail (BLOCK_V shrunk),
    chunks with a short last one: values and gradients of logprob and entropy."""
    from asyncrl.training import triton_head

    saved, triton_head.BLOCK_V = triton_head.BLOCK_V, 32
    try:
        g = torch.Generator().manual_seed(0)
        N, H, V = 9, 16, 75
        hidden = torch.randn(N, H, generator=g).to(DEVICE).requires_grad_()
        weight = torch.randn(V, H, generator=g).to(DEVICE).requires_grad_()
        targets = torch.randint(0, V, (N,), generator=g).to(DEVICE)
        up_lp, up_ent = torch.randn(2, N, generator=g).to(DEVICE)
        lp, ent = linear_logprobs(hidden, weight, targets, temperature, 4, True, row_kernel="triton")
        loss = (lp * up_lp).sum() + ((ent * up_ent).sum() if with_entropy_grad else 0.0)
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
        ref_lp, ref_ent = _reference(hidden, weight, targets, temperature)
        ref_loss = (ref_lp * up_lp.double()).sum() + ((ref_ent * up_ent.double()).sum() if with_entropy_grad else 0.0)
        rh, rw = torch.autograd.grad(ref_loss, (hidden, weight))
    finally:
        triton_head.BLOCK_V = saved
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh.double(), rh.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw.double(), rw.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_bf16_triton_head_equals_the_torch_row_kernel():
    """bf16 on the GPU: the two row kernels read the same bf16 logits; they agree to fp32 rounding."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(300, 64, generator=g).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(5000, 64, generator=g) * 0.1).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, 5000, (300,), generator=g).cuda()
    results = []
    for kernel in ("torch", "triton"):
        lp, ent = linear_logprobs(hidden, weight, targets, 0.9, 128, True, row_kernel=kernel)
        grads = torch.autograd.grad((lp - 0.01 * ent).sum(), (hidden, weight))
        results.append((lp, ent, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
