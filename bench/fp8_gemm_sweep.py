"""FP8 GEMM sweep (issue 23): which FP8 linear beats bf16 at the Qwen3-0.6B shapes, and where the
time of the blockwise path goes. One H200, < 1 min.

  shapes    qkv 1024 -> 4096, o 2048 -> 1024, gate_up 1024 -> 6144, down 3072 -> 1024; M = 256 (a decode
            step of workload a) and 4,096 (prefill)
  schemes   bf16        ``F.linear``
            block_main  main's path before this branch: the one-warp Triton group quantization (kept here,
                        verbatim, as the baseline) + ``F.scaled_mm`` BlockWise1x128 x BlockWise128x128
            block       the engine's ``fp8_scaling=block``: the one-pass multi-warp Triton kernel + the same GEMM
            channel     the engine's ``fp8_scaling=channel``: per-token Triton kernel + ``torch._scaled_mm``
                        rowwise (scale_a [M, 1], scale_b [1, N]; CUTLASS on sm90), fp32 accumulation
            channel_fa  the same with ``use_fast_accum=True`` (Hopper's FP8 accumulator: faster, drops bits)
            tensor      per-tensor scales (dynamic: amax of the whole input in torch) + tensorwise ``_scaled_mm``
            tensor_fa   the same with ``use_fast_accum=True``
  parts     quant (activation quantization alone), gemm (the FP8 GEMM alone, x already quantized), full
  timing    graph_us: 20 calls captured in one CUDA graph, replayed, CUDA events (GPU time only);
            eager_us: 200 eager calls, wall clock over a synchronize (host launch work included: when it
            exceeds graph_us the call is host-bound)
  error     rel_err_vs_bf16 = ||y - y_bf16||_F / ||y_bf16||_F, rel_err_vs_fp32 against the fp32 product
  kv        the engine's paged decode attention (one layer, 16 q / 8 kv heads, D 128, block 64) with a
            bf16 vs an e4m3 KV cache at workload (a)'s decode (256 x 260 / 384 / 512) and (c)'s full
            batch (256 x 1000): graph_us and TB/s of K/V bytes read with the engine's launch, and the
            best of a few larger tiles per dtype (e4m3 tiles are half the bytes: a bigger BLOCK_N may
            be what lets them pay; ``ASYNCRL_DECODE_LAUNCH`` sets it in the engine). ``--no-kv`` skips it
  step_ms   workload (a)'s mid decode step (batch 256, context 384) estimated from these: 28 x (the
            layer's four linears at M = 256 + one attention layer), per linear scheme x KV dtype

    python bench/fp8_gemm_sweep.py --json bench/results/fp8_gemm_sweep_h200.json

Look at ``layer_us`` (the four linears of one decoder layer summed, graph_us of ``full``) and its
``speedup_vs_bf16`` per scheme and M: the scheme to make the engine's default is the one above 1.0 at
M = 256. ``step_ms`` says how much of a decode step FP8 weights and the FP8 KV cache can move (the
LM head, norms, RoPE, sampling and host work are not in it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine import fp8, fp8_channel  # noqa: E402
from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.triton_fp8 import quantize_rows_cuda, quantize_tokens_cuda  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}  # (N, K)


@triton.jit
def _main_quantize_groups(x_ptr, q_ptr, s_ptr, M, K, stride_xm, Mp, Kp,
                          AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr):
    """main's kernel (the baseline): program (row, group), one warp, 128 channels."""
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=(row < M) & (cols < K), other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_MIN)
    scale = tl.math.div_rn(amax, QMAX)
    q = tl.clamp(tl.math.div_rn(x, scale), -QMAX, QMAX)
    tl.store(q_ptr + row * Kp + cols, q.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + group * Mp + row, scale)


def main_quantize_tokens(x: torch.Tensor, k_padded: int):
    m, k = x.shape
    mp, groups = fp8.padded(max(m, 1), 4), k_padded // fp8.BLOCK
    q = torch.empty(mp, k_padded, dtype=fp8.FP8, device=x.device)
    scale_t = torch.empty(groups, mp, dtype=torch.float32, device=x.device)
    _main_quantize_groups[(mp, groups)](x, q, scale_t, m, k, x.stride(0), mp, k_padded, AMAX_MIN=fp8.AMAX_FLOOR,
                                        QMAX=fp8.FP8_MAX, GROUP=fp8.BLOCK, num_warps=1)
    return q, scale_t


def blockwise_gemm(xq, xs_t, wq, ws):
    return F.scaled_mm(xq, wq.t(), xs_t.t(), F.ScalingType.BlockWise1x128, ws.t(), F.ScalingType.BlockWise128x128,
                       output_dtype=torch.bfloat16)


def tensor_quantize(x: torch.Tensor, k_padded: int):
    """Per-tensor dynamic scale (amax over the whole input), in torch: a reduction, then one cast."""
    scale = fp8.scale_of(x.abs().amax().float())
    q = fp8.to_fp8(F.pad(x, (0, k_padded - x.shape[1])).float(), scale)
    return q, scale


def schemes(w: torch.Tensor) -> dict:
    """name -> (quant(x), gemm(quantized), full(x)) for one bf16 weight ``w [N, K]``."""
    n, k = w.shape
    bq, bs = fp8.quantize_weight(w, fp8.padded_k(k))
    cq, cs = fp8_channel.quantize_rows(w, fp8_channel.padded_k(k))
    tscale = fp8.scale_of(w.abs().amax().float())
    tq = fp8.to_fp8(F.pad(w.float(), (0, fp8_channel.padded_k(k) - k)), tscale)
    kb, kc = bq.shape[1], cq.shape[1]

    def rowwise(fast):
        return lambda a: torch._scaled_mm(a[0], cq.t(), scale_a=a[1], scale_b=cs.t(), out_dtype=torch.bfloat16,
                                          use_fast_accum=fast)

    def tensorwise(fast):
        return lambda a: torch._scaled_mm(a[0], tq.t(), scale_a=a[1], scale_b=tscale, out_dtype=torch.bfloat16,
                                          use_fast_accum=fast)

    table = {
        "block_main": (lambda x: main_quantize_tokens(x, kb), lambda a: blockwise_gemm(a[0], a[1], bq, bs)),
        "block": (lambda x: quantize_tokens_cuda(x, kb), lambda a: blockwise_gemm(a[0], a[1], bq, bs)),
        "channel": (lambda x: quantize_rows_cuda(x, kc), rowwise(False)),
        "channel_fa": (lambda x: quantize_rows_cuda(x, kc), rowwise(True)),
        "tensor": (lambda x: tensor_quantize(x, kc), tensorwise(False)),
        "tensor_fa": (lambda x: tensor_quantize(x, kc), tensorwise(True)),
    }
    out = {"bf16": (None, None, lambda x: F.linear(x, w))}
    for name, (quant, gemm) in table.items():
        out[name] = (quant, gemm, lambda x, quant=quant, gemm=gemm: gemm(quant(x))[:x.shape[0], :n])
    return out


def graph_us(fn, reps: int = 20, replays: int = 10) -> float:
    """GPU time of one ``fn()``: ``reps`` calls captured in one CUDA graph, replayed ``replays`` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (reps * replays)


def eager_us(fn, calls: int = 200) -> float:
    """Wall time of one eager ``fn()`` over ``calls`` back-to-back calls (host launch work included)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return round(((y.float() - ref.float()).norm() / ref.float().norm()).item(), 5)


def measure(name: str, parts, x: torch.Tensor, w: torch.Tensor) -> dict:
    quant, gemm, full = parts
    row = dict(full_graph_us=round(graph_us(lambda: full(x)), 2), full_eager_us=round(eager_us(lambda: full(x)), 2))
    if quant is not None:
        quantized = quant(x)
        row.update(quant_graph_us=round(graph_us(lambda: quant(x)), 2),
                   gemm_graph_us=round(graph_us(lambda: gemm(quantized)), 2),
                   gemm_eager_us=round(eager_us(lambda: gemm(quantized)), 2))
    y = full(x)
    row.update(rel_err_vs_bf16=rel_err(y, F.linear(x, w)), rel_err_vs_fp32=rel_err(y, x.float() @ w.float().t()))
    return row


KV_SHAPES = [(256, 260), (256, 384), (256, 512), (256, 1000)]  # (batch, context)
LAYERS = 28                                                      # Qwen3-0.6B


KV_LAUNCHES = [(128, 4, 2), (128, 8, 2), (128, 8, 3)]  # (block_n, warps, stages) tried beside the engine's


def kv_attention() -> dict:
    """The paged decode kernel on a bf16 vs an e4m3 cache (same values, rounded), GPU us per call:
    the engine's launch (``{dtype}_us``) and the best of :data:`KV_LAUNCHES` (``{dtype}_best``)."""
    from paged_decode_sweep import D, HKV, case  # bench/ is this script's directory

    from asyncrl.engine.triton_decode import DECODE_LAUNCH, DecodeLaunch, paged_decode_attention

    out = {}
    for batch, context in KV_SHAPES:
        q, kc, vc, bt, lens = case(batch, context)
        row = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", fp8.FP8)):
            k, v = kc.to(dtype), vc.to(dtype)
            us = graph_us(lambda: paged_decode_attention(q, k, v, bt, lens, D ** -0.5))
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_tb_per_s"] = round(2 * batch * context * HKV * D * k.element_size() / (us * 1e-6) / 1e12, 2)
            tried = {}
            for spec in KV_LAUNCHES:
                launch = DecodeLaunch(*spec, kv_splits=DECODE_LAUNCH.kv_splits)
                try:
                    tried[spec] = graph_us(lambda: paged_decode_attention(q, k, v, bt, lens, D ** -0.5, launch=launch))
                except Exception:  # noqa: BLE001 - e.g. out of shared memory: that launch is not a candidate
                    continue
            if tried:
                best = min(tried, key=tried.get)
                row[f"{name}_best"] = dict(launch=",".join(map(str, best)), us=round(tried[best], 2))
        row["fp8_speedup"] = round(row["bf16_us"] / row["fp8_us"], 3)
        out[f"b{batch}_ctx{context}"] = row
        print(f"kv       B={batch:4d} ctx={context:5d} {json.dumps(row)}", flush=True)
    return out


def step_estimate(results: dict) -> dict:
    """ms of workload (a)'s mid decode step's linears + attention, per linear scheme x KV dtype."""
    layer, kv = results["layer_us"].get("m256", {}), results.get("kv", {}).get("b256_ctx384")
    if not layer or not kv:
        return {}
    return {f"{scheme}+kv_{dtype}": round(LAYERS * (row["us"] + kv[f"{dtype}_us"]) / 1e3, 3)
            for scheme, row in layer.items() for dtype in ("bf16", "fp8")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="256,4096", help="rows (tokens) of the input")
    ap.add_argument("--no-kv", action="store_true", help="skip the paged decode attention on bf16 vs FP8 K/V")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    results = dict(provenance(" ".join(sys.argv)), triton=triton.__version__, gemms={}, layer_us={})
    ms = [int(m) for m in args.ms.split(",")]
    for lname, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        table = schemes(w)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for name, parts in table.items():
                try:  # a path this GPU / torch lacks is reported, the others still run
                    row = measure(name, parts, x, w)
                except Exception as err:  # noqa: BLE001
                    row = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
                results["gemms"][f"{lname}_m{m}_{name}"] = row
                print(f"{lname:8s} M={m:5d} {name:11s} {json.dumps(row)}", flush=True)
    for m in ms:
        per_scheme = {}
        for name in table:
            rows = [results["gemms"][f"{lname}_m{m}_{name}"] for lname in SHAPES]
            if all("error" not in r for r in rows):
                per_scheme[name] = round(sum(r["full_graph_us"] for r in rows), 1)
        bf16 = per_scheme.get("bf16")
        results["layer_us"][f"m{m}"] = {name: dict(us=us, speedup_vs_bf16=round(bf16 / us, 3) if bf16 else None)
                                       for name, us in per_scheme.items()}
    if not args.no_kv:
        try:
            results["kv"] = kv_attention()
        except Exception as err:  # noqa: BLE001 - reported, the GEMM numbers stand
            results["kv"] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
        results["step_ms"] = step_estimate(results)
    print(json.dumps({k: results.get(k) for k in ("layer_us", "step_ms")}, indent=1), flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
