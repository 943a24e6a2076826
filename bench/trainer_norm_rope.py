"""Trainer norms at the peer shape (issue 20): q/k RMSNorm + RoPE and the hidden RMSNorm, forward
and forward+backward, Liger (as HF's Qwen3Attention runs it: [1, T, H, D], transposed views,
Liger's RoPE, back to [T, H, D] for the varlen attention) vs the fused Triton kernels
(asyncrl/training/triton_qk_norm_rope.py, on [T, H, D]); HF's eager modules as a third row.

    python bench/trainer_norm_rope.py [--json PATH]          # CUDA: T = 36,736, bf16
    TRITON_INTERPRET=1 python bench/trainer_norm_rope.py     # CPU: tiny, fp32, checks it runs

Prints one JSON object: per case and path, median milliseconds (CUDA events) of the forward and
of forward+backward, and the max abs difference of the output and the gradients (dx, dw) from
an fp32 reference computed from the same inputs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from asyncrl.training import triton_qk_norm_rope as fused

CUDA = torch.cuda.is_available()


def _positions(prompts: int, rows: int, prompt_len: int, response_len: int, device) -> torch.Tensor:
    """The varlen layout's positions: per prompt 0..P-1, then each row's inputs P..P+L-2."""
    group = [torch.arange(prompt_len)] + [torch.arange(prompt_len, prompt_len + response_len - 1)] * rows
    return torch.cat(group * prompts).to(device)


def _timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs (after two warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _rotary(positions, head_dim, theta, dtype):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    config = Qwen3Config(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": theta})
    rotary = Qwen3RotaryEmbedding(config).to(positions.device)
    cos, sin = rotary(torch.empty(0, dtype=dtype, device=positions.device), positions[None])
    return rotary.inv_freq, cos, sin


def _hf_norm(x, w, eps):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _qk_paths(xq, xk, wq, wk, positions, inv_freq, cos, sin, eps):
    """name -> fn(xq, xk, wq, wk) -> (q, k) as [T, H, D] contiguous (what the varlen attention takes)."""
    T = xq.shape[0]

    def hf_layout(norm, rope):
        def run(xq, xk, wq, wk):
            q = norm(xq.view(1, T, *xq.shape[1:]), wq).transpose(1, 2)  # HF: [1, H, T, D] views
            k = norm(xk.view(1, T, *xk.shape[1:]), wk).transpose(1, 2)
            q, k = rope(q, k)
            return q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous()  # varlen_attention's
        return run

    def hf_rope(q, k):
        c, s = cos[:, None], sin[:, None]
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    paths = {"hf_eager": hf_layout(lambda x, w: _hf_norm(x, w, eps), hf_rope)}
    if CUDA:
        try:
            from liger_kernel.ops import LigerRMSNormFunction, LigerRopeFunction
            paths["liger"] = hf_layout(lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False),
                                       lambda q, k: LigerRopeFunction.apply(q, k, cos, sin, None, 1))
        except ImportError:
            pass
    paths["triton_fused"] = lambda xq, xk, wq, wk: (fused.qk_norm_rope(xq, wq, eps, positions, inv_freq),
                                                    fused.qk_norm_rope(xk, wk, eps, positions, inv_freq))
    return paths


def _norm_paths(eps):
    paths = {"hf_eager": lambda x, w: _hf_norm(x, w, eps)}
    if CUDA:
        try:
            from liger_kernel.ops import LigerRMSNormFunction
            paths["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        except ImportError:
            pass
    paths["triton"] = lambda x, w: fused.rms_norm(x, w, eps)
    return paths


def _measure(fn, inputs, grads, reference, iters):
    """Forward ms, forward+backward ms, max abs diffs (outputs, input grads) from ``reference``."""
    leaves = [t.detach().requires_grad_() for t in inputs]

    def forward():
        with torch.enable_grad():
            return _tuple(fn(*leaves))

    def forward_backward():
        outs = forward()
        torch.autograd.backward(outs, grads)

    fwd_ms, fb_ms = _timed(forward, iters), _timed(forward_backward, iters)
    for leaf in leaves:
        leaf.grad = None
    outs = forward()
    torch.autograd.backward(outs, grads)
    pairs = list(zip([*outs, *(leaf.grad for leaf in leaves)], reference))
    return {"forward_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fb_ms, 4), "backward_ms": round(fb_ms - fwd_ms, 4),
            "max_abs_diff": [float(f"{float((a.detach().float() - b).abs().max()):.3g}") for a, b in pairs],
            "max_rel_diff": [float(f"{float((a.detach().float() - b).abs().max() / b.abs().max()):.3g}") for a, b in pairs]}


def _reference(fn, inputs, grads):
    """fp32 autograd of ``fn`` on the inputs upcast: outputs then input gradients."""
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    outs = _tuple(fn(*leaves))
    torch.autograd.backward(outs, [g.float() for g in grads])
    return [o.detach() for o in outs] + [leaf.grad for leaf in leaves]


def _tuple(outs):
    return outs if isinstance(outs, tuple) else (outs,)


def _speedups(rows: dict, ours: str) -> dict:
    """Forward+backward time of each other path over ours (2.0: ours takes half the time)."""
    return {f"{name}_over_{ours}": round(row["fwd_bwd_ms"] / rows[ours]["fwd_bwd_ms"], 3)
            for name, row in rows.items() if name != ours}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16 if CUDA else 2)
    parser.add_argument("--rows", type=int, default=8 if CUDA else 2)
    parser.add_argument("--prompt-len", type=int, default=256 if CUDA else 5)
    parser.add_argument("--response-len", type=int, default=256 if CUDA else 4)
    parser.add_argument("--q-heads", type=int, default=16 if CUDA else 2)
    parser.add_argument("--kv-heads", type=int, default=8 if CUDA else 1)
    parser.add_argument("--head-dim", type=int, default=128 if CUDA else 64)
    parser.add_argument("--hidden", type=int, default=1024 if CUDA else 96)
    parser.add_argument("--theta", type=float, default=1e6)
    parser.add_argument("--iters", type=int, default=20 if CUDA else 2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device, dtype, eps = ("cuda", torch.bfloat16, 1e-6) if CUDA else ("cpu", torch.float32, 1e-6)
    g = torch.Generator(device=device).manual_seed(0)
    positions = _positions(args.prompts, args.rows, args.prompt_len, args.response_len, device)
    T, D = positions.shape[0], args.head_dim
    inv_freq, cos, sin = _rotary(positions, D, args.theta, dtype)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)  # noqa: E731
    qk_inputs = [rand(T, args.q_heads, D), rand(T, args.kv_heads, D), rand(D, scale=0.1) + 1, rand(D, scale=0.1) + 1]
    qk_grads = [rand(T, args.q_heads, D), rand(T, args.kv_heads, D)]
    norm_inputs, norm_grads = [rand(T, args.hidden), rand(args.hidden, scale=0.1) + 1], [rand(T, args.hidden)]
    qk_paths = _qk_paths(*qk_inputs, positions, inv_freq, cos, sin, eps)
    fp32_cos, fp32_sin = _rotary(positions, D, args.theta, torch.float32)[1:]
    qk_ref = _reference(_qk_paths(*qk_inputs, positions, inv_freq, fp32_cos, fp32_sin, eps)["hf_eager"],
                        qk_inputs, qk_grads)
    norm_paths = _norm_paths(eps)
    norm_ref = _reference(norm_paths["hf_eager"], norm_inputs, norm_grads)
    result = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "dtype": str(dtype), "tokens": T,
              "q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": D, "hidden": args.hidden,
              "diff_order": "qk: [q, k, dxq, dxk, dwq, dwk]; norm: [y, dx, dw]",
              "qk_norm_rope": {name: _measure(fn, qk_inputs, qk_grads, qk_ref, args.iters)
                               for name, fn in qk_paths.items()},
              "hidden_rms_norm": {name: _measure(fn, norm_inputs, norm_grads, norm_ref, args.iters)
                                  for name, fn in norm_paths.items()}}
    result["speedup_fwd_bwd"] = {case: _speedups(result[case], ours)
                                 for case, ours in (("qk_norm_rope", "triton_fused"), ("hidden_rms_norm", "triton"))}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
