"""Triton row kernels for the fused LM head: log-prob of the sampled token at temperature T and
the entropy, forward statistics and the exact gradient w.r.t. the logits.

Liger Kernel fuses the linear layer with a cross-entropy (the log-prob at T = 1, scaled by a
per-token weight) but has no entropy term and no temperature; these two kernels are that piece.
They work on one chunk of logits ``x [c, V]`` as the head's matmul wrote it (bf16 on a GPU, in
the model's dtype), one program per row, streaming over V in blocks, so the fp32 ``[c, V]``
copy the torch path makes (and its dozen elementwise passes) never exists:

    z = x / T,   lse = log sum_j exp(z_j),   logprob = z[target] - lse,
    H = lse - sum_j p_j z_j                    (p = exp(z - lse), the entropy)

Forward is an online softmax (running max m, s = sum exp(z - m), t = sum exp(z - m) z), so each
row is read once. Backward overwrites the same buffer with

    dL/dx_j = (g_lp (1[j = target] - p_j) - g_H p_j (z_j - lse + H)) / T

(d logprob/dz = onehot - p; dH/dz_j = -p_j (log p_j + H)), read and written once, in the
buffer's dtype; the two matmuls of the head's backward then read it. The torch reference of
the same formulas is head_logprobs.py; tests/training/test_triton_head.py checks both against
float64 autograd under ``TRITON_INTERPRET=1`` on the CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary columns per step of a row's loop (151,936 / 4,096: 38 steps)
NUM_WARPS = 8  # 256 threads per row program: 16 columns each per step, as Liger's cross-entropy rows
# V is a compile-time constant (one compile per vocabulary size; the interpreter also needs it so)


@triton.jit
def _stats_kernel(x_ptr, x_stride, target_ptr, lse_ptr, logprob_ptr, entropy_ptr, V: tl.constexpr, temperature,
                  WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_stride
    m = -float("inf")
    s = 0.0
    t = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < V
        z = tl.load(base + cols, mask=valid, other=-float("inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        rescale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # 0 on the masked tail
        s = s * rescale + tl.sum(e, axis=0)
        if WITH_ENTROPY:
            t = t * rescale + tl.sum(tl.where(valid, e * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(target_ptr + row)
    z_target = tl.load(base + target).to(tl.float32) / temperature
    tl.store(lse_ptr + row, lse)
    tl.store(logprob_ptr + row, z_target - lse)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, lse - t / s)


@triton.jit
def _grad_kernel(x_ptr, x_stride, target_ptr, lse_ptr, entropy_ptr, g_logprob_ptr, g_entropy_ptr, V: tl.constexpr,
                 temperature,
                 HAS_ENTROPY_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_stride
    lse = tl.load(lse_ptr + row)
    g_lp = tl.load(g_logprob_ptr + row)
    target = tl.load(target_ptr + row)
    if HAS_ENTROPY_GRAD:
        g_ent = tl.load(g_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < V
        z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) / temperature
        p = tl.exp(z - lse)
        grad = tl.where(cols == target, g_lp, 0.0) - g_lp * p
        if HAS_ENTROPY_GRAD:
            grad -= g_ent * p * (z - lse + entropy)
        tl.store(base + cols, (grad / temperature).to(x_ptr.dtype.element_ty), mask=valid)


def row_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """logits ``[c, V]`` (any float dtype, rows contiguous), targets ``[c]`` -> fp32 ``(lse,
    logprob, entropy)``, each ``[c]`` (entropy empty unless ``with_entropy``)."""
    rows, vocab = logits.shape
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    if rows:
        _stats_kernel[(rows,)](logits, logits.stride(0), targets, out[0], out[1], out[2], vocab, float(temperature),
                               WITH_ENTROPY=with_entropy, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return out[0], out[1], out[2] if with_entropy else out[2, :0]


def grad_logits_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy, g_logprob: torch.Tensor,
                 g_entropy, temperature: float) -> torch.Tensor:
    """Overwrites ``logits [c, V]`` with dL/dlogits for upstream gradients ``g_logprob [c]`` and
    ``g_entropy [c]`` (or None: no entropy term); returns it."""
    rows, vocab = logits.shape
    has_entropy = g_entropy is not None
    if rows:
        _grad_kernel[(rows,)](logits, logits.stride(0), targets, lse, entropy if has_entropy else lse,
                              g_logprob.float().contiguous(),
                              g_entropy.float().contiguous() if has_entropy else lse, vocab, float(temperature),
                              HAS_ENTROPY_GRAD=has_entropy, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return logits
