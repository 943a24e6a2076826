"""Fused MoE at Qwen3-30B-A3B's layer shape on one GPU: the old kernel vs the new, and a tile sweep.

Layer shape: hidden 2048, moe_intermediate 768, 128 experts, top-8, bf16, random weights and
router logits (routing as the engine computes it). For T = 32, 256 (decode batches) and 16,384
(a prefill step) tokens:

1. checks every variant against the fp32 torch reference (``moe.moe_experts_torch``): mean and
   max abs error relative to the reference's mean magnitude (bf16 rounding: ~1e-3 .. 1e-2);
2. times (triton ``do_bench``, median, L2 flushed between calls) one layer's experts: the old
   ``fused_moe`` (main before this change: 64x64 tiles, torch SiLU/mul/sum glue, kept below as
   the baseline), the new one with the table's row (``triton_moe_tiles.TILE_TABLE``), a few
   Triton tile candidates around it and the ``torch._grouped_mm`` backend; us per layer (the
   whole call, routing alignment included; ``align`` alone is printed too), GB/s (weights of the
   experts hit + activations, read and written once) and TFLOP/s (2 x pairs x H x 3I);
3. prints the fastest variant per size and the ``TILE_TABLE`` row to paste.

    python bench/moe_gemm_tune.py --json out.json [--no-sweep]      # ~1-2 min on one H200
    python bench/moe_gemm_tune.py --offline    # no GPU: each tile's shared memory and registers on sm90

Exits 1 if a variant failed or its error is out of bf16's range (mean > 2e-2 of the mean
magnitude); the other variants still run and are written.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.models.moe import moe_experts_torch, route  # noqa: E402
from asyncrl.engine.triton_moe import (align_pairs, experts_grouped_mm, experts_triton, fused_moe,  # noqa: E402
                                       grouped_mm_supported)
from asyncrl.engine.triton_moe_tiles import GemmTile, MoeTiles, pick_tiles  # noqa: E402

E, TOP_K, H, INTER = 128, 8, 2048, 768
DEVICE = "cuda"
HBM_BYTES_PER_S = 4.8e12  # H200's HBM3e peak: the decode floor printed with each size
TOKENS = (32, 256, 16384)
T_ = MoeTiles  # short names for the candidate lists
G = GemmTile
CANDIDATES = {  # Triton tiles tried besides the table's row, per token count
    32: (T_(16, G(32, 128, 4, 4), G(64, 128, 4, 4)), T_(16, G(64, 64, 4, 4), G(64, 64, 4, 4)),
         T_(16, G(128, 128, 4, 2), G(256, 128, 4, 2)), T_(16, G(64, 256, 4, 2), G(128, 256, 4, 2))),
    256: (T_(16, G(64, 128, 4, 3), G(128, 128, 4, 3)), T_(32, G(128, 128, 4, 2), G(256, 128, 4, 2)),  # vLLM's
          T_(32, G(64, 64, 4, 4), G(128, 64, 4, 4)), T_(64, G(64, 128, 4, 2), G(128, 128, 4, 2))),
    16384: (T_(128, G(64, 64, 8, 4), G(128, 64, 8, 4)), T_(64, G(128, 64, 4, 4), G(128, 64, 4, 4)),
            T_(128, G(128, 64, 8, 3), G(128, 128, 8, 3))),  # + the table's own Triton tiles
}


# ---- the baseline: fused_moe as on main before this change (b6a8d3c), verbatim in behaviour ----
@triton.jit
def _old_grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, pairs_ptr, block_expert_ptr, weight_ptr,
                             num_pairs, N, a_row_div, stride_am, stride_we, stride_wn, stride_cm,
                             K: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    valid = pair < num_pairs
    rows = (pair // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + kk[:, None],
                    mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc += tl.dot(a, w)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def _old_gemm(a, w, out, sorted_pairs, block_expert, block_m, a_row_div, weights=None):
    num_pairs, N = out.shape
    grid = (block_expert.numel(), triton.cdiv(N, 64))
    _old_grouped_gemm_kernel[grid](a, w, out, sorted_pairs, block_expert, weights if weights is not None else out,
                                   num_pairs, N, a_row_div, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                                   K=a.shape[1], MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=64,
                                   BLOCK_K=64)


def old_fused_moe(x, w13, w2, weights, ids):
    T, top_k = ids.shape
    two_i = w13.shape[1]
    block_m = 64 if T * top_k >= 4 * 64 * w13.shape[0] else 16
    sorted_pairs, block_expert = align_pairs(ids, w13.shape[0], block_m)
    gate_up = torch.empty(T * top_k, two_i, dtype=x.dtype, device=x.device)
    _old_gemm(x, w13, gate_up, sorted_pairs, block_expert, block_m, top_k)
    h = F.silu(gate_up[:, :two_i // 2]) * gate_up[:, two_i // 2:]
    y = torch.empty(T * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _old_gemm(h.contiguous(), w2, y, sorted_pairs, block_expert, block_m, 1, weights.reshape(-1).contiguous())
    return y.view(T, top_k, -1).sum(1)


# ---- measurement -------------------------------------------------------------------------------
def layer(T: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, H, device=DEVICE, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * INTER, H, device=DEVICE, generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, INTER, device=DEVICE, generator=g) * INTER ** -0.5).to(torch.bfloat16)
    logits = torch.randn(T, E, device=DEVICE, generator=g).to(torch.bfloat16)
    weights, ids = route(logits, TOP_K, renormalize=True)
    return x, w13, w2, weights, ids


def traffic(T: int, ids: torch.Tensor) -> tuple[float, float]:
    """(bytes, flops) of one layer: the weights of the experts hit, x, h and y written and read,
    out written (bf16); 2 x pairs x H x 3I multiply-adds."""
    hit = ids.unique().numel()
    pairs = T * TOP_K
    weight_bytes = hit * 3 * INTER * H * 2
    act_bytes = 2 * (T * H + 2 * pairs * INTER + 2 * pairs * H + T * H)
    return weight_bytes + act_bytes, 2.0 * pairs * H * 3 * INTER


def row(name: str, fn, args, ref, T: int, rep_ms: int, tiles: MoeTiles | None = None) -> dict:
    """One variant: its error against ``ref`` and its time; a variant that raises is recorded
    (``error``) and the run goes on (one GPU run should bring back every other number)."""
    try:
        return _measure(name, fn, args, ref, T, rep_ms, tiles)
    except Exception as err:  # noqa: BLE001 - reported in the results and the exit status
        print(f"  {name:<70} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
        return {"variant": name, "tiles": tiles, "error": f"{type(err).__name__}: {err}"[:2000],
                "us_per_layer": float("inf"), "mean_err": float("nan"), "max_err": float("nan")}


def _measure(name: str, fn, args, ref, T: int, rep_ms: int, tiles) -> dict:
    out = fn(*args)
    torch.cuda.synchronize()
    err = (out.float() - ref).abs()
    scale = ref.abs().mean().item()
    us = do_bench(lambda: fn(*args), warmup=10, rep=rep_ms, return_mode="median") * 1e3
    nbytes, flops = traffic(T, args[4])
    r = {"variant": name, "tiles": tiles, "us_per_layer": round(us, 1), "GB_s": round(nbytes / us / 1e3, 1),
         "TFLOP_s": round(flops / us / 1e6, 1), "mean_err": err.mean().item() / scale,
         "max_err": err.max().item() / scale}
    print(f"  {name:<70} {r['us_per_layer']:>9.1f} us {r['GB_s']:>8.1f} GB/s {r['TFLOP_s']:>7.1f} TFLOP/s  "
          f"err mean {r['mean_err']:.1e} max {r['max_err']:.1e}", flush=True)
    return r


def describe(t: MoeTiles) -> str:
    u, d = t.up, t.down
    return (f"triton M{t.block_m} up {u.block_n}x{u.block_k} w{u.num_warps} s{u.num_stages}"
            f" down {d.block_n}x{d.block_k} w{d.num_warps} s{d.num_stages}")


def bench_size(T: int, sweep: bool) -> dict:
    args = layer(T)
    x, w13, w2, weights, ids = args
    ref = moe_experts_torch(x.float(), w13.float(), w2.float(), weights.float(), ids)
    rep = 200 if T >= 4096 else 60
    table = pick_tiles(T * TOP_K, E, INTER, H)
    hit = ids.unique().numel()
    floor_us = hit * 3 * INTER * H * 2 / HBM_BYTES_PER_S * 1e6
    print(f"T={T} ({T * TOP_K} pairs, {hit} experts hit: their weights alone take {floor_us:.0f} us at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s), table row: {table}", flush=True)
    align_us = do_bench(lambda: align_pairs(ids, E, table.block_m), warmup=10, rep=rep, return_mode="median") * 1e3
    print(f"  align_pairs alone (block_m {table.block_m}): {align_us:.1f} us", flush=True)
    rows = [row("old fused_moe (main b6a8d3c)", old_fused_moe, args, ref, T, rep),
            row(f"new: table row ({table.backend})", fused_moe, args, ref, T, rep)]
    if sweep:
        table_triton = MoeTiles(table.block_m, table.up, table.down)
        for cand in (table_triton,) + CANDIDATES.get(T, ()):
            rows.append(row(describe(cand), lambda *a, c=cand: experts_triton(*a, c), args, ref, T, rep, cand))
        if grouped_mm_supported(x, w13, w2):
            rows.append(row("grouped_mm (torch._grouped_mm + Triton SiLU*mul / top-k sum)", experts_grouped_mm,
                            args, ref, T, rep, "grouped_mm"))
    del ref
    torch.cuda.empty_cache()
    for r in rows:
        r["vs_old"] = round(rows[0]["us_per_layer"] / r["us_per_layer"], 2) if "error" not in r else None
    return {"tokens": T, "pairs": T * TOP_K, "experts_hit": hit, "weight_floor_us": round(floor_us, 1),
            "align_us": round(align_us, 1), "table": str(table), "rows": rows}


def paste_row(result: dict) -> str:
    """The fastest swept variant as a TILE_TABLE line (the best Triton tiles, with the
    grouped_mm backend if that was faster still)."""
    swept = [r for r in result["rows"] if r["tiles"] is not None and "error" not in r]
    if not any(r["tiles"] != "grouped_mm" for r in swept):
        return "(no Triton variant swept)"
    best = min(swept, key=lambda r: r["us_per_layer"])
    tiles = min((r for r in swept if r["tiles"] != "grouped_mm"), key=lambda r: r["us_per_layer"])["tiles"]
    if best["tiles"] == "grouped_mm":
        tiles = MoeTiles(tiles.block_m, tiles.up, tiles.down, "grouped_mm")
    return f"fastest {best['variant']} {best['us_per_layer']} us; the row for {result['pairs']} pairs: {tiles!r}"


# ---- offline: compile for sm90 without a GPU ---------------------------------------------------
def offline_report() -> int:
    """Compile every table row and candidate of the 30B shape for sm90 (``triton.compile`` with an
    explicit target and the 16-byte alignment hints the launcher gives torch tensors; ptxas from
    the triton wheel) and print shared memory, registers and stack per thread (0 LOCAL = no
    spills). Needs no GPU: checks a table edit before the GPU run."""
    from sm90_offline import compile_sm90, register_usage

    from asyncrl.engine.triton_moe import _moe_gemm_kernel
    from asyncrl.engine.triton_moe_tiles import TILE_TABLE

    kernel = _moe_gemm_kernel
    ptrs = ("a_ptr", "w_ptr", "c_ptr", "weight_ptr")
    sig = {n: "*bf16" for n in ptrs} | {"pairs_ptr": "*i32", "block_expert_ptr": "*i32"}
    sig |= {n: "i32" for n in ("num_pairs", "N", "a_row_div", "stride_am", "stride_we", "stride_wn", "stride_cm")}
    aligned = [n for n in sig if n not in ("num_pairs", "a_row_div")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    seen = set()
    tiles = [t for _, t in TILE_TABLE[(E, INTER, H)]] + [t for ts in CANDIDATES.values() for t in ts]
    for t in tiles:
        for name, tile, k, gated in (("up", t.up, H, True), ("down", t.down, INTER, False)):
            if (t.block_m, tile, gated) in seen:
                continue
            seen.add((t.block_m, tile, gated))
            consts = {"K": k, "GATED": gated, "MUL_WEIGHT": not gated, "DOT_FP32": False, "BLOCK_M": t.block_m,
                      "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k}
            compiled = compile_sm90(kernel, sig | {n: "constexpr" for n in consts}, consts, attrs,
                                    tile.num_warps, tile.num_stages)
            regs = register_usage(compiled)
            print(f"M{t.block_m:<4} {name:<4} {tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}: "
                  f"shared {compiled.metadata.shared // 1024} KiB, {regs}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-sweep", action="store_true", help="old vs the table's row only")
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--offline", action="store_true",
                    help="no GPU: compile the tiles for sm90 and print shared memory and registers")
    args = ap.parse_args()
    if args.offline:
        return offline_report()
    start = time.time()
    results = [bench_size(T, not args.no_sweep) for T in args.tokens]
    print("\nfastest per size (paste the winning tiles into triton_moe_tiles.TILE_TABLE[(128, 768, 2048)]):")
    for r in results:
        old = r["rows"][0]["us_per_layer"]
        table = r["rows"][1]["us_per_layer"]
        print(f"  T={r['tokens']}: table row {table} us vs old {old} us: {old / table:.2f}x; {paste_row(r)}")
    # out of bf16's range, or failed (error: NaN)
    bad = [(r["tokens"], x["variant"]) for r in results for x in r["rows"] if not x["mean_err"] <= 2e-2]
    out = {"bench": "moe_gemm_tune", **provenance(" ".join(sys.argv)), "triton": triton.__version__,
           "shape": {"experts": E, "top_k": TOP_K, "hidden": H, "moe_intermediate": INTER},
           "seconds": round(time.time() - start, 1), "results": results, "errors_out_of_range": bad}
    for r in results:
        for x in r["rows"]:
            x["tiles"] = x["tiles"] if x["tiles"] in (None, "grouped_mm") else repr(x["tiles"])
    write_json(args.json, out)
    print(f"done in {out['seconds']} s" + (f"; FAILED or error out of range: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
