"""Launch-shape sweep of the Triton paged-decode kernel (GPU), at the rollout benchmark's shapes.

One attention layer of a Qwen3-0.6B-shaped model (16 q heads, 8 kv heads, D 128, block 64,
bf16), K/V blocks scattered at random over the pool. Shapes (batch, context): workload (a)'s
decode at its start, middle and end (256 x 260 / 384 / 512), workload (c)'s full batch at a
long context (256 x 1000) and its shrinking tail (64 x 1400, 16 x 1500, 4 x 1500).

For each launch (tile BLOCK_N, warps, pipeline stages; split-KV chunks chosen per batch as the
engine does, or forced to 1) it times the kernel (triton ``do_bench``, median), checks it
against the default launch's output, and reports the rate in TB/s of K/V bytes read. The
best launch minimises the summed time over the shapes (weights: (a)'s three shapes count
as its decode, (c)'s four as its own); it is printed as ``BEST block_n,warps,stages``, the
form ``ASYNCRL_DECODE_LAUNCH`` takes, so the same device call can run the engine with it.

    python bench/paged_decode_sweep.py --json out.json [--best-file best.txt]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402

SHAPES = [(256, 260), (256, 384), (256, 512), (256, 1000), (64, 1400), (16, 1500), (4, 1500)]
H, HKV, D, PAGE = 16, 8, 128, 64


KV_DTYPE = [torch.bfloat16]  # --kv-dtype fp8: the caches in e4m3 (kv_cache_dtype="fp8")


def case(batch: int, context: int, seed: int = 0):
    """q [B, H, D], caches [N + 1, PAGE, HKV, D] (``KV_DTYPE``), block tables [B, M] int32, lens [B] int32."""
    rng = np.random.default_rng(seed)
    per = -(-context // PAGE)
    ids = rng.permutation(batch * per).astype(np.int32)
    dev = torch.device("cuda")
    kc = torch.randn(batch * per + 1, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kc, vc = kc.to(KV_DTYPE[0]), vc.to(KV_DTYPE[0])
    q = torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16)
    bt = torch.from_numpy(ids.reshape(batch, per)).to(dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return q, kc, vc, bt, lens


def launches():
    """(block_n, warps, stages, kv_splits): kv_splits 0 = per batch (the engine's rule)."""
    grid = [(32, w, st, 0) for w, st in itertools.product((2, 4), (2, 3, 4))]
    grid += [(64, w, st, 0) for w, st in itertools.product((4, 8), (2, 3, 4))]
    grid += [(128, w, st, 0) for w, st in itertools.product((4, 8), (2, 3))]
    return grid + [(64, 4, 3, 1)]  # the launch before this sweep: no split-KV


def sweep() -> tuple[list[dict], tuple]:
    from triton.testing import do_bench

    from asyncrl.engine.triton_decode import DecodeLaunch, paged_decode_attention

    rows, totals = [], {}
    for batch, context in SHAPES:
        q, kc, vc, bt, lens = case(batch, context)
        scale = D ** -0.5
        ref = paged_decode_attention(q, kc, vc, bt, lens, scale, launch=DecodeLaunch(64, 4, 3, 1)).float()
        kv_bytes = 2 * batch * context * HKV * D * kc.element_size()
        for spec in launches():
            launch = DecodeLaunch(*spec)
            try:
                out = paged_decode_attention(q, kc, vc, bt, lens, scale, launch=launch)
                err = (out.float() - ref).abs().max().item()
                ms = do_bench(lambda: paged_decode_attention(q, kc, vc, bt, lens, scale, launch=launch),
                              warmup=20, rep=60)
            except Exception as exc:  # e.g. out of shared memory for a big tile x many stages
                rows.append({"batch": batch, "context": context, "launch": spec, "error": repr(exc)[:200]})
                totals[spec] = float("inf")
                continue
            rows.append({"batch": batch, "context": context, "launch": spec, "us": ms * 1e3,
                         "tb_per_s": kv_bytes / (ms * 1e-3) / 1e12, "max_abs_diff": err})
            if err > 5e-2:
                raise SystemExit(f"launch {spec} disagrees at {batch}x{context}: max abs diff {err}")
            totals[spec] = totals.get(spec, 0.0) + ms
    best = min(totals, key=totals.get)
    return rows, best, totals


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--best-file", default=None, help="write the best launch as block_n,warps,stages,kv_splits")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"), help="the caches' dtype (fp8: e4m3)")
    args = ap.parse_args()
    KV_DTYPE[0] = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    rows, best, totals = sweep()
    base = totals[(64, 4, 3, 1)]
    for (b, c) in SHAPES:
        line = [r for r in rows if r["batch"] == b and r["context"] == c and "us" in r]
        top = sorted(line, key=lambda r: r["us"])[:3]
        old = next(r for r in line if r["launch"] == (64, 4, 3, 1))
        print(f"{b:4d} x {c:5d}: before {old['us']:8.1f} us {old['tb_per_s']:.2f} TB/s | best " +
              "; ".join(f"{r['launch']} {r['us']:.1f} us {r['tb_per_s']:.2f} TB/s" for r in top))
    print(f"summed over shapes: before {base * 1e3:.1f} us, best {best} {totals[best] * 1e3:.1f} us "
          f"({base / totals[best]:.2f}x)")
    print("BEST " + ",".join(map(str, best)))
    if args.best_file:
        with open(args.best_file, "w") as f:
            f.write(",".join(map(str, best)))
    write_json(args.json, {**provenance(" ".join(sys.argv)), "kv_dtype": args.kv_dtype, "shapes": SHAPES, "rows": rows,
                           "best": best, "summed_us": {",".join(map(str, k)): v * 1e3 for k, v in totals.items()}})


if __name__ == "__main__":
    main()
