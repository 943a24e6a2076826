"""Log-probs and entropy of target tokens through the LM head, fused: never store [N, V] logits.

``linear_logprobs(hidden, weight, targets, T)`` = ``log_softmax(hidden @ weight.T / T)[targets]``
and the entropy of that softmax, both with exact gradients. The generic way (a chunked,
checkpointed ``linear -> float -> / T -> logsumexp -> gather``) costs, per chunk, a dozen full
passes over the fp32 [chunk, V] logits in forward and backward, plus a zero-filled [chunk, V]
gradient for ``gather``'s backward; with Qwen's 151,936-token vocabulary that was ~30% of a GPU
actor update (bench/actor_update_gpu.py).

Here forward keeps only per-row statistics (the log-normaliser ``lse`` and the entropy ``H``,
[N] each); backward recomputes each chunk's logits once and forms, in place,

    dL/dz = g_lp * (onehot - p) - g_H * p * (z - lse + H),    z = logits / T, p = exp(z - lse)

(divided by T for dL/dlogits), then the two matmuls. Two implementations of the per-chunk row
math: torch ops on an fp32 copy (any device; the reference), and Triton kernels that read and
write the matmul's own output in place (triton_head.py; CUDA, chosen by ``row_kernel="triton"``).
Same values and gradients as float64 autograd (tests/training/test_head_logprobs.py).
"""
from __future__ import annotations

import torch

ROW_KERNELS = ("torch", "triton")


def acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """Softmax math in fp32 (fp64 for fp64 inputs: the tests' reference precision)."""
    return torch.promote_types(hidden.dtype, torch.float32)


def _torch_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """The torch reference of triton_head.row_stats: logits [c, V] -> (lse, logprob, entropy) [c]."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprob = z.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lse, logprob, lse.new_zeros(0)
    expected = (z - lse[:, None]).exp_().mul_(z).sum(-1)  # E_p[z]
    return lse, logprob, lse - expected


def _torch_grad_logits(logits, targets, lse, entropy, g_logprob, g_entropy, temperature: float) -> torch.Tensor:
    """The torch reference of triton_head.grad_logits_: dL/dlogits [c, V] in the logits' dtype."""
    z = logits.to(lse.dtype)
    if temperature != 1.0:
        z = z / temperature
    probs = (z - lse[:, None]).exp()
    grad = probs * -g_logprob[:, None]
    if g_entropy is not None:  # dH/dz = -p (z - lse + H)
        grad -= probs * (z - lse[:, None] + entropy[:, None]) * g_entropy[:, None]
    grad.scatter_add_(1, targets[:, None], g_logprob[:, None])
    if temperature != 1.0:
        grad /= temperature
    return grad.to(logits.dtype)


def _row_ops(row_kernel: str):
    if row_kernel == "triton":
        from asyncrl.training import triton_head
        return triton_head.row_stats, triton_head.grad_logits_
    return _torch_stats, _torch_grad_logits


class _LinearLogprobs(torch.autograd.Function):
    """Autograd op for ``linear_logprobs``; ``chunk`` rows at a time (memory: one [chunk, V]
    logits buffer, plus its fp32 copy on the torch row kernel)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool, row_kernel: str):
        stats, _ = _row_ops(row_kernel)
        n = hidden.shape[0]
        dtype = acc_dtype(hidden)
        lse, logprobs = (torch.empty(n, dtype=dtype, device=hidden.device) for _ in range(2))
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk):
            lse_c, lp_c, ent_c = stats(hidden[s:s + chunk] @ weight.T, targets[s:s + chunk], temperature, with_entropy)
            lse[s:s + chunk], logprobs[s:s + chunk] = lse_c, lp_c
            if with_entropy:
                entropy[s:s + chunk] = ent_c
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.row_kernel = temperature, chunk, row_kernel
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        _, grad_logits = _row_ops(ctx.row_kernel)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        g_logprob = torch.zeros_like(lse) if g_logprob is None else g_logprob.to(lse.dtype)
        if g_entropy is not None and g_entropy.numel():
            g_entropy = g_entropy.to(lse.dtype)
        else:
            g_entropy = None
        chunk = ctx.chunk
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            g_ent = g_entropy[s:s + chunk] if g_entropy is not None else None
            ent = entropy[s:s + chunk] if g_entropy is not None else None
            grad = grad_logits(h @ weight.T, targets[s:s + chunk], lse[s:s + chunk], ent, g_logprob[s:s + chunk],
                               g_ent, ctx.temperature).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s:s + chunk] = grad @ weight
            if grad_weight is not None:
                grad_weight.add_(grad.T @ h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False,
                    row_kernel: str = "torch"):
    """hidden ``[N, H]``, weight ``[V, H]`` (the LM head, no bias), targets ``[N]`` int64
    -> log-probs ``[N]`` float32 (float64 for float64 inputs) of ``targets`` under
    ``softmax(hidden @ weight.T / temperature)``, and the entropy ``[N]`` of that softmax
    (``with_entropy``; else empty), both differentiable. ``row_kernel``: "torch" (any device)
    or "triton" (CUDA, or the Triton interpreter)."""
    if row_kernel not in ROW_KERNELS:
        raise ValueError(f"row_kernel must be one of {ROW_KERNELS}, got {row_kernel!r}")
    return _LinearLogprobs.apply(hidden, weight, targets.contiguous(), float(temperature), max(1, int(chunk_tokens)),
                                 bool(with_entropy), row_kernel)
