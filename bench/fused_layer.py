"""A decode layer's GEMMs and glue, the engine's kernels against ``triton_gemm``'s (the glue inside the GEMMs).

Times, in CUDA graphs (``triton.testing.do_bench_cudagraph``), a stack of ``--layers`` decoder layers without their
attention (its output is a fixed tensor, so both chains do the same work around it) at ``M`` rows:

  engine   add + RMSNorm (``triton_norm``), qkv ``F.linear``, o ``F.linear``, add + RMSNorm, gate_up ``F.linear``,
           SwiGLU (``triton_silu``), down ``F.linear``: seven kernels a layer (nine with attention's two)
  fused    ``norm_linear`` (qkv), ``linear_residual`` (o), ``norm_linear`` + SwiGLU (gate_up), ``linear_residual``
           (down): four kernels (six with attention's)

and reports us per layer, the ratio and the max abs difference of the last hidden state. Then each fused kernel
alone over a sweep of tiles / warps / stages (``--sweep``), against the engine's ``triton_gemm.LAUNCH``: what to
set there. Shapes: Qwen3-0.6B (``--shape 0.6b``) or Qwen3-8B (``8b``); bf16.

    python bench/fused_layer.py --ms 256,128,64 --sweep --json bench/results/fused_layer.json   # ~3 min, H200
    python bench/fused_layer.py --offline   # no GPU: each kernel compiled for sm90, its registers / spills / smem
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402

# hidden, intermediate, q + 2 kv columns of the qkv projection, q columns (attention's output)
SHAPES = {"0.6b": (1024, 3072, 4096, 2048), "8b": (4096, 12288, 6144, 4096)}
EPS = 1e-6


def layer_weights(shape: str, layers: int, g: torch.Generator, dtype=torch.bfloat16) -> list[dict]:
    """Random weights of ``layers`` layers of ``SHAPES[shape]`` on g's device."""
    hidden, inter, qkv, q = SHAPES[shape]

    def w(n, k):
        return (torch.randn(n, k, device=g.device, generator=g) / k ** 0.5).to(dtype)

    def norm():
        return (1 + 0.1 * torch.randn(hidden, device=g.device, generator=g)).to(dtype)

    return [dict(qkv=w(qkv, hidden), o=w(hidden, q), gate_up=w(2 * inter, hidden), down=w(hidden, inter),
                 ln1=norm(), ln2=norm(), inter=inter) for _ in range(layers)]


def engine_chain(x, attn_out, layers):
    """The engine's kernels today (``decoder.DecoderLayer.forward`` with attention's output fixed)."""
    from asyncrl.engine.triton_norm import rms_norm
    from asyncrl.engine.triton_silu import silu_and_mul

    h, residual = rms_norm(x, layers[0]["ln1"], EPS), x
    for i, lw in enumerate(layers):
        if i:
            h, residual = rms_norm(h, lw["ln1"], EPS, residual)
        F.linear(h, lw["qkv"])  # feeds attention, whose output here is attn_out
        h, residual = rms_norm(F.linear(attn_out, lw["o"]), lw["ln2"], EPS, residual)
        h = F.linear(silu_and_mul(F.linear(h, lw["gate_up"]), lw["inter"]), lw["down"])
    return h.float() + residual.float()  # the last hidden state (the final norm's input, unrounded)


def fused_chain(x, attn_out, layers):
    """``decoder.DecoderLayer.forward_fused`` with attention's output fixed."""
    from asyncrl.engine.triton_gemm import linear_residual, norm_linear, sum_squares

    h, ss = x, sum_squares(x)
    for lw in layers:
        norm_linear(h, ss, lw["ln1"], lw["qkv"], EPS)
        h, ss = linear_residual(attn_out, lw["o"], h)
        h, ss = linear_residual(norm_linear(h, ss, lw["ln2"], lw["gate_up"], EPS, inter=lw["inter"]), lw["down"], h)
    return h.float()


def configs() -> list[tuple]:
    """(BM, BN, BK, warps, stages) candidates."""
    tiles = itertools.product((64, 128), (32, 64, 128), (64, 128))
    return [(bm, bn, bk, w, s) for (bm, bn, bk), (w, s) in itertools.product(tiles, ((4, 3), (4, 4), (8, 3)))]


def sweep_kernels(M: int, shape: str, g: torch.Generator) -> list[dict]:
    """Each fused kernel at M rows over ``configs()``: the engine's launch and the fastest, us (CUDA graphs)."""
    from triton.testing import do_bench_cudagraph

    from asyncrl.engine.triton_gemm import launch, linear_residual, norm_linear

    lw = layer_weights(shape, 1, g)[0]
    hidden, inter, _, q = SHAPES[shape]
    h = torch.randn(M, hidden, device="cuda", generator=g).to(torch.bfloat16)
    a_o = torch.randn(M, q, device="cuda", generator=g).to(torch.bfloat16)
    a_down = torch.randn(M, inter, device="cuda", generator=g).to(torch.bfloat16)
    ss = linear_residual(a_o, lw["o"], h)[1]
    cases = {
        "qkv (norm prologue)": ("norm", hidden, lw["qkv"].shape[0],
                                lambda c: norm_linear(h, ss, lw["ln1"], lw["qkv"], EPS, config=c)),
        "gate_up (norm + SwiGLU)": ("swiglu", hidden, inter,
                                    lambda c: norm_linear(h, ss, lw["ln2"], lw["gate_up"], EPS, inter=inter, config=c)),
        "o (residual epilogue)": ("residual", q, hidden, lambda c: linear_residual(a_o, lw["o"], h, config=c)),
        "down (residual epilogue)": ("residual", inter, hidden,
                                     lambda c: linear_residual(a_down, lw["down"], h, config=c)),
    }
    rows = []
    for name, (kind, K, N, run) in cases.items():
        engine = launch(kind, K, N)
        timed = {}
        for config in [engine] + [c for c in configs() if c != engine]:
            try:
                timed[config] = do_bench_cudagraph(lambda: run(config), rep=20) * 1e3
            except Exception as exc:  # noqa: BLE001 - out of shared memory / registers: not a candidate
                print(f"  {name} {config}: {repr(exc)[:100]}", flush=True)
        best = min(timed, key=timed.get)
        rows.append(dict(m=M, kernel=name, engine_launch=engine, engine_us=round(timed[engine], 2),
                         best=best, best_us=round(timed[best], 2)))
        print(rows[-1], flush=True)
    return rows


def offline(shape: str) -> list[dict]:
    """The engine's launch of each fused kernel at ``shape`` compiled for sm90 (``bench/sm90_offline.py``): registers,
    stack, spills (LOCAL) and shared memory, without a GPU."""
    from sm90_offline import compile_sm90, register_usage

    from asyncrl.engine import triton_gemm as tg

    hidden, inter, qkv, q = SHAPES[shape]
    rows = []
    for name, kind, K, N in (("qkv", "norm", hidden, qkv), ("gate_up", "swiglu", hidden, inter),
                             ("o", "residual", q, hidden), ("down", "residual", inter, hidden)):
        bm, bn, bk, warps, stages = tg.launch(kind, K, N)
        consts = dict(BM=bm, BN=bn, BK=bk, PREC="tf32")
        w_desc = f"tensordesc<bf16[{bn}, {bk}]>"
        if kind == "residual":
            kernel = tg._linear_residual_kernel
            sig = dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>", w_desc=w_desc, RES="*bf16", H="*bf16", SS="*fp32",
                       M="i32", N="i32", K="i32", stride_res="i32", stride_h="i32", stride_ss="i32")
        else:
            kernel = tg._norm_linear_kernel
            consts |= dict(BP=32, SWIGLU=kind == "swiglu")
            sig = dict(h_desc=f"tensordesc<bf16[{bm}, {bk}]>", SS="*fp32", NW="*bf16", w_desc=w_desc, C="*bf16",
                       M="i32", N="i32", K="i32", P="i32", eps="fp32", stride_ss="i32", stride_c="i32", INTER="i32")
        sig |= {k: "constexpr" for k in consts}
        compiled = compile_sm90(kernel, sig, consts, {}, warps, stages)
        rows.append(dict(kernel=name, launch=(bm, bn, bk, warps, stages), usage=register_usage(compiled),
                         shared_bytes=compiled.metadata.shared))
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="256,128,64")
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=8, help="layers per timed graph (launch gaps included)")
    ap.add_argument("--sweep", action="store_true", help="also sweep each fused kernel's launch")
    ap.add_argument("--offline", action="store_true", help="compile for sm90 without a GPU and report resources")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.offline:
        write_json(args.json, dict(provenance(" ".join(sys.argv)), offline=offline(args.shape)))
        return 0
    from triton.testing import do_bench_cudagraph

    out = dict(provenance(" ".join(sys.argv)), chains=[], sweeps=[])
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = layer_weights(args.shape, args.layers, g)
    hidden, _, _, q = SHAPES[args.shape]
    for M in map(int, args.ms.split(",")):
        x = torch.randn(M, hidden, device="cuda", generator=g).to(torch.bfloat16)
        attn_out = torch.randn(M, q, device="cuda", generator=g).to(torch.bfloat16)
        diff = (fused_chain(x, attn_out, layers) - engine_chain(x, attn_out, layers)).abs().max().item()
        us = {name: do_bench_cudagraph(lambda: chain(x, attn_out, layers), rep=50) * 1e3 / args.layers
              for name, chain in (("engine", engine_chain), ("fused", fused_chain))}
        row = dict(m=M, shape=args.shape, engine_us_per_layer=round(us["engine"], 2),
                   fused_us_per_layer=round(us["fused"], 2), fused_x=round(us["engine"] / us["fused"], 3),
                   max_abs_diff_last_hidden=diff)
        print(row, flush=True)
        out["chains"].append(row)
        if args.sweep:
            out["sweeps"] += sweep_kernels(M, args.shape, g)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
