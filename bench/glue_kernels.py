"""A layer's elementwise glue on the GPU: the fused q/k norm + RoPE + K/V cache write
(``triton_qkv.qkv_to_cache``), SwiGLU's ``silu(gate) * up`` (``triton_silu.silu_and_mul`` vs the compiled
torch ``decoder.silu_and_mul``) and the residual add + RMSNorm (``triton_norm.rms_norm`` vs the compiled
``decoder.add_rms_norm``, hidden 1,024), at decode (64-256 rows) and prefill (1k-16k rows) shapes of Qwen3-0.6B
(16 q heads, 8 kv heads, head dim 128, intermediate 3,072), bf16.

Why: a profile of workload (c)'s prefill steps (bench/RESULTS.md, 2026-12-04 session 48) put the qkv kernel at
15% and Inductor's SiLU at 13% of the prefill's device time, each reading and writing its bytes at 1.1-1.6 TB/s.

Each launch shape (tokens per program, [columns per program,] warps) is timed by CUDA-graph replay (triton's
``do_bench_cudagraph``, median; the engine replays decode in graphs) and checked: qkv against the launch (1, 1)
(q and both caches bit for bit), SiLU and the norm against eager torch (``F.silu(gate) * up``,
``decoder._add_rms_norm``: mismatching elements and the largest difference). GB/s counts each byte read or
written once.

    python bench/glue_kernels.py --json bench/results/glue_kernels_h200.json   # ~1 min on one H200
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.engine import triton_norm, triton_qkv, triton_silu  # noqa: E402
from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.models import decoder  # noqa: E402

H, HKV, D, INTER, HIDDEN = 16, 8, 128, 3072, 1024
TOKENS = (64, 128, 188, 256, 1024, 4096, 16384)
QKV_LAUNCHES = ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (16, 4), (16, 8), (32, 8))
SILU_LAUNCHES = ((1, 1024, 4), (1, 512, 4), (1, 1024, 8), (1, 2048, 8), (2, 512, 4), (2, 1024, 4),
                 (4, 256, 4), (4, 512, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 8), (16, 256, 8), (16, 512, 8))
NORM_LAUNCHES = ((1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (16, 8))
BLOCKS, PAGE = 4096, 64


def graph_ms(fn) -> float:
    from triton.testing import do_bench_cudagraph
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=50, return_mode="median")


def rope_tables(max_pos: int = 4096):
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float, device="cuda") / D))
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float, device="cuda"), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


def qkv_rows(T: int, cos, sin, kc, vc) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(T)
    qkv = torch.randn(T, (H + 2 * HKV) * D, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, cos.shape[0], (T,), device="cuda", generator=g)
    slots = torch.randperm(BLOCKS * PAGE, device="cuda", generator=g)[:T]
    qw = (torch.rand(D, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    kw = (torch.rand(D, device="cuda", generator=g) + 0.5).to(torch.bfloat16)

    def call(launch):
        return triton_qkv.qkv_to_cache(qkv, pos, cos, sin, qw, kw, 1e-6, H, HKV, D, kc, vc, slots, launch=launch)

    q_ref = call((1, 1))
    k_ref, v_ref = kc.view(-1, HKV, D)[slots].clone(), vc.view(-1, HKV, D)[slots].clone()
    nbytes = T * (H + 2 * HKV) * D * 2 + T * (H + 2 * HKV) * D * 2 + T * 8 * 2  # read qkv, write q/k/v; pos+slot
    rows = []
    for launch in QKV_LAUNCHES:
        kc.view(-1, HKV, D)[slots] = 0
        vc.view(-1, HKV, D)[slots] = 0
        q = call(launch)
        same = (torch.equal(q, q_ref) and torch.equal(kc.view(-1, HKV, D)[slots], k_ref)
                and torch.equal(vc.view(-1, HKV, D)[slots], v_ref))
        ms = graph_ms(lambda: call(launch))
        rows.append(dict(kernel="qkv", tokens=T, launch=list(launch), ms=round(ms, 5), same_as_1x1=same,
                         gb_s=round(nbytes / ms / 1e6, 1)))
    return rows


def silu_rows(T: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(T + 1)
    gate_up = (torch.randn(T, 2 * INTER, device="cuda", generator=g) * 2).to(torch.bfloat16)
    gate, up = gate_up.split(INTER, dim=-1)
    eager = F.silu(gate) * up
    nbytes = T * 3 * INTER * 2
    compiled = decoder.silu_and_mul  # the engine's path before: torch.compile (Inductor)
    rows = []

    def check(out) -> dict:
        diff = (out.float() - eager.float()).abs()
        return dict(mismatches=int((out != eager).sum()), max_abs_diff=float(diff.max()))

    ms = graph_ms(lambda: compiled(gate_up, INTER))
    rows.append(dict(kernel="silu", tokens=T, launch="inductor", ms=round(ms, 5), gb_s=round(nbytes / ms / 1e6, 1),
                     **check(compiled(gate_up, INTER))))
    for launch in SILU_LAUNCHES:
        ms = graph_ms(lambda: triton_silu.silu_and_mul(gate_up, INTER, launch=launch))
        rows.append(dict(kernel="silu", tokens=T, launch=list(launch), ms=round(ms, 5),
                         gb_s=round(nbytes / ms / 1e6, 1), **check(triton_silu.silu_and_mul(gate_up, INTER, launch))))
    return rows


def norm_rows(T: int) -> list[dict]:
    """The residual add + RMSNorm (the decoder's ``add_rms_norm``, 2 of its 3 calls per layer)."""
    g = torch.Generator(device="cuda").manual_seed(T + 2)
    x, res = (torch.randn(2, T, HIDDEN, device="cuda", generator=g) * 2).to(torch.bfloat16)
    w = (torch.rand(HIDDEN, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    ref, ref_sum = decoder._add_rms_norm(x, res, w, 1e-6)
    nbytes = T * HIDDEN * 2 * 4  # read x and residual, write both outputs
    rows = []

    def check(out) -> dict:
        return dict(mismatches=int((out[0] != ref).sum()) + int((out[1] != ref_sum).sum()),
                    max_abs_diff=float((out[0].float() - ref.float()).abs().max()))

    ms = graph_ms(lambda: decoder.add_rms_norm(x, res, w, 1e-6))
    rows.append(dict(kernel="norm", tokens=T, launch="inductor", ms=round(ms, 5), gb_s=round(nbytes / ms / 1e6, 1),
                     **check(decoder.add_rms_norm(x, res, w, 1e-6))))
    for launch in NORM_LAUNCHES:
        ms = graph_ms(lambda: triton_norm.rms_norm(x, w, 1e-6, res, launch=launch))
        rows.append(dict(kernel="norm", tokens=T, launch=list(launch), ms=round(ms, 5),
                         gb_s=round(nbytes / ms / 1e6, 1), **check(triton_norm.rms_norm(x, w, 1e-6, res, launch))))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--kernels", default="qkv,silu,norm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cos, sin = rope_tables()
    kc = torch.zeros(BLOCKS + 1, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    rows = []
    for T in map(int, args.tokens.split(",")):
        picked = args.kernels.split(",")
        batch = ((qkv_rows(T, cos, sin, kc, vc) if "qkv" in picked else []) + (silu_rows(T) if "silu" in picked else [])
                 + (norm_rows(T) if "norm" in picked else []))
        for row in batch:
            print(json.dumps(row), flush=True)
            rows.append(row)
    for kernel in args.kernels.split(","):
        print(f"{kernel}: best launch per row count (ms; the default launch's ms)")
        for T in map(int, args.tokens.split(",")):
            mine = [r for r in rows if r["kernel"] == kernel and r["tokens"] == T]
            best = min(mine, key=lambda r: r["ms"])
            print(f"  T={T:6d} best {best['launch']} {best['ms']:.4f} ms ({best['gb_s']} GB/s); "
                  f"first {mine[0]['launch']} "
                  f"{mine[0]['ms']:.4f} -> {mine[0]['ms'] / best['ms']:.2f}x")
    write_json(args.json, dict(provenance("python bench/glue_kernels.py " + " ".join(sys.argv[1:])), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
