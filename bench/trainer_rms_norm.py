"""RMSNorm forward + backward at a GRPO update's shapes: Liger's backward vs triton_rms_norm's.

Issue 8's peer shape (16 x 8 rows x (256 + 256) tokens in the varlen layout: T = 36,736 tokens),
Qwen3-0.6B: the hidden norms [T, 1,024], q_norm [1, T, 16, 128], k_norm [1, T, 8, 128]; bf16,
CUDA events, median of ``--reps``. Both use Liger's forward; the gradients are compared.

    python bench/trainer_rms_norm.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

SHAPES = {"hidden": (36736, 1024), "q_norm": (1, 36736, 16, 128), "k_norm": (1, 36736, 8, 128)}


def time_backward(function, x, w, dy, reps: int) -> tuple[float, tuple]:
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()

    def once():
        xi.grad = wi.grad = None
        function.apply(xi, wi, 1e-6, 0.0, "llama", False).backward(dy)

    for _ in range(3):
        once()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), (xi.grad.float(), wi.grad.float())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from liger_kernel.ops import LigerRMSNormFunction

    from asyncrl.training.triton_rms_norm import wide_rms_norm_function

    out = {"device": torch.cuda.get_device_name(), "rows": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, shape in SHAPES.items():
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
        w = 1 + 0.1 * torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
        liger_us, (dx0, dw0) = time_backward(LigerRMSNormFunction, x, w, dy, args.reps)
        wide_us, (dx1, dw1) = time_backward(wide_rms_norm_function(), x, w, dy, args.reps)
        out["rows"][name] = dict(shape=shape, liger_us=round(liger_us, 1), wide_us=round(wide_us, 1),
                                 speedup=round(liger_us / wide_us, 2),
                                 dx_max_abs_diff=float((dx0 - dx1).abs().max()),
                                 dw_max_rel_diff=float((dw0 - dw1).abs().max() / dw0.abs().max()))
        print(name, json.dumps(out["rows"][name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
