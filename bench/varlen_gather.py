"""The varlen key gather's backward: index_add_ (autograd of index_select) vs varlen_gather's.

At the issue-8 GRPO shape (16 prompts x 8 samples x (256 + 256) tokens: T = 36,736 tokens, K = 69,504
key slots), one layer's K (or V) gather [T, 8, 128] bf16 -> [K, 8, 128], forward + backward, timed with
CUDA events (median of ``--reps`` after warm-up). Prints JSON: old_us, new_us, speedup, the largest
difference of the two gradients and of each against the float64 sum.

    python bench/varlen_gather.py [--json out.json]          # GPU
    python bench/varlen_gather.py --device cpu --tiny        # a dry run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from actor_update_gpu import make_batch  # noqa: E402

from asyncrl.training.varlen import varlen_rows  # noqa: E402
from asyncrl.training.varlen_gather import gather_key_slots  # noqa: E402


def timed(fn, device: str, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="2 prompts x 4 samples x (16 + 16)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shape = (2, 4, 16, 16) if args.tiny else (16, 8, 256, 256)
    batch = make_batch(*shape, 1000, "cpu")
    rows = varlen_rows(batch.input_ids, batch.attention_mask, batch.prompt_length)
    rows.key_index = rows.key_index.to(args.device)
    for name in ("first_slot", "extra_tokens", "extra_slots"):
        setattr(rows.slots, name, getattr(rows.slots, name).to(args.device))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    g = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(rows.tokens, 8, 128, device=args.device, dtype=dtype, generator=g).requires_grad_()
    upstream = torch.randn(rows.key_index.numel(), 8, 128, device=args.device, dtype=dtype, generator=g)

    def run(slots):
        x.grad = None
        gather_key_slots(x, rows.key_index, slots).backward(upstream)
        return x.grad

    grads = {name: run(slots).clone() for name, slots in (("old", None), ("new", rows.slots))}
    exact = torch.zeros(rows.tokens, 8, 128, dtype=torch.float64, device=args.device)
    exact.index_add_(0, rows.key_index, upstream.double())
    out = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", dtype=str(dtype),
               tokens=rows.tokens, key_slots=rows.key_index.numel(),
               old_us=round(timed(lambda: run(None), args.device, args.reps), 1),
               new_us=round(timed(lambda: run(rows.slots), args.device, args.reps), 1),
               max_abs_diff=float((grads["old"].double() - grads["new"].double()).abs().max()),
               old_err_vs_fp64=float((grads["old"].double() - exact).abs().max()),
               new_err_vs_fp64=float((grads["new"].double() - exact).abs().max()))
    out["speedup"] = round(out["old_us"] / out["new_us"], 2)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
