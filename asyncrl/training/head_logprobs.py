"""Log-probs of target tokens through the LM head, fused by hand: never store [N, V] logits.

``linear_logprobs(hidden, weight, targets, T)`` = ``log_softmax(hidden @ weight.T / T)[targets]``.
The generic way (a chunked, checkpointed ``linear -> float -> / T -> logsumexp -> gather``)
costs, per chunk, a dozen full passes over the fp32 [chunk, V] logits in forward and
backward, plus a zero-filled [chunk, V] gradient for ``gather``'s backward; with Qwen's
151,936-token vocabulary that was ~30% of a GPU actor update (bench/actor_update_gpu.py).

Here forward keeps only the per-row log-normaliser ``lse`` [N]; backward recomputes each
chunk's logits once and forms ``dL/dlogits = g * (onehot - softmax) / T`` in place (the
softmax is ``exp(logits / T - lse)``), then the two matmuls. Same values and gradients as
the generic path (tests/training/test_head_logprobs.py, float64 reference).
"""
from __future__ import annotations

import torch


def acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """Softmax math in fp32 (fp64 for fp64 inputs: the tests' reference precision)."""
    return torch.promote_types(hidden.dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, H] x [V, H] -> fp32 logits / T, [n, V] (a fresh tensor: safe to modify in place)."""
    logits = (hidden @ weight.T).to(acc_dtype(hidden))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _LinearLogprobs(torch.autograd.Function):
    """Autograd op for ``linear_logprobs``; ``chunk`` rows at a time (memory: one fp32 [chunk, V])."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=acc_dtype(hidden), device=hidden.device)
        logprobs = torch.empty(n, dtype=acc_dtype(hidden), device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=acc_dtype(hidden), device=hidden.device)
        for s in range(0, n, chunk):
            logits = _chunk_logits(hidden[s:s + chunk], weight, temperature)
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            logprobs[s:s + chunk] = logits.gather(1, targets[s:s + chunk, None]).squeeze(1) - lse[s:s + chunk]
            if with_entropy:  # H = lse - E_p[z], a metric here: no gradient (see linear_logprobs)
                expected = (logits.sub(lse[s:s + chunk, None]).exp_().mul_(logits)).sum(-1)
                entropy[s:s + chunk] = lse[s:s + chunk] - expected
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_out = grad_out.to(lse.dtype)
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s:s + chunk], grad_out[s:s + chunk]
            probs = _chunk_logits(h, weight, T).sub_(lse[s:s + chunk, None]).exp_()  # softmax(logits / T)
            # d logprob[t] / d logits = (onehot(t) - softmax) / T, times the incoming g
            grad_logits = probs.mul_(-g[:, None]).scatter_add_(1, targets[s:s + chunk, None], g[:, None])
            if T != 1.0:
                grad_logits.div_(T)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s:s + chunk] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.add_(grad_logits.T @ h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False):
    """hidden ``[N, H]``, weight ``[V, H]`` (the LM head, no bias), targets ``[N]`` int64
    -> log-probs ``[N]`` float32 (float64 for float64 inputs) of ``targets`` under
    ``softmax(hidden @ weight.T / temperature)``, and the entropy ``[N]`` of that softmax
    (``with_entropy``; else empty) WITHOUT a gradient: for the entropy as a metric. A loss
    with an entropy bonus takes the generic path (logprobs.py)."""
    return _LinearLogprobs.apply(hidden, weight, targets, float(temperature), max(1, int(chunk_tokens)),
                                 bool(with_entropy))
