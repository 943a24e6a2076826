"""Qwen3.5 speed levers, A/B in one run (one GPU): engine tok/s on issue 4's workload (a) with each
lever off and on, HF ``generate`` on the same workload in the same run, and each lever's kernel.

    python bench/qwen35_levers.py --json bench/results/qwen35_levers_h200.json   # ~3-4 min, one H200
    python bench/qwen35_levers.py --profile ...   # also where a decode step's time goes with both levers on
    python bench/qwen35_levers.py --device cpu --shape tiny-qwen3.5 --batch 4 --prompt 16 --response 8  # smoke

Levers (issue 22; bench/RESULTS.md "Model families"):
  state   the Gated DeltaNet state's storage dtype, ``mamba_ssm_cache_dtype`` fp32 (the default for
          released Qwen3.5 checkpoints) vs bf16: decode reads and writes each sequence's state once
          per layer per step (1 MiB per layer in fp32 at the 0.8B shape), half the bytes in bf16;
  conv    the packed GPU prefill's short conv through FLA's varlen ``causal_conv1d`` (one kernel
          over the packed tokens, ``GatedDeltaNet.packed_conv``) vs the torch conv over the batch
          padded to ``[B, L, C]`` (shifted multiply-adds).

Rows: baseline = fp32 state + torch conv (the engine before these levers); +conv; +conv +bf16 state
(both levers); bf16 state alone. Each row: one untimed run of the workload, then one timed run
(the engine's tok/s counts generated tokens over the whole call, prefill included), and the mean
|log p_engine - log p_HF| of its first ``--mismatch-seqs`` completions under the HF model's bf16
forward (the trainer's view). Kernels: the GDN decode step at batch ``--batch`` with an fp32 vs a
bf16 state pool (one layer; us and the state bytes moved per us), and the prefill conv of the whole
workload's prompts, torch vs FLA (one layer). Random bf16 weights from the config
(``model_families.SHAPES``), no download. Needs torch 2.11+, transformers 5.x, triton, fla-core.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from asyncrl.engine import LLM  # noqa: E402
from asyncrl.engine import bench as engine_bench  # noqa: E402
from asyncrl.engine.bench import (_rand_prompts, profile_steps, provenance, run_engine, run_hf,  # noqa: E402
                                  write_json)
from asyncrl.types import SamplingParams  # noqa: E402
from fp8_rollout import mismatch  # noqa: E402
from model_families import build_hf  # noqa: E402

ROWS = [  # (name, mamba_ssm_cache_dtype, FLA conv at prefill)
    ("baseline: fp32 state, torch conv", "float32", False),
    ("+ FLA conv", "float32", True),
    ("+ FLA conv + bf16 state", "bfloat16", True),
    ("bf16 state, torch conv", "bfloat16", False),
]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(llm) -> None:
    llm.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_packed_conv(llm, on: bool) -> None:
    for gdn in llm.model.linear_layers():
        gdn.packed_conv = on


def timed_us(fn, device: str, iters: int = 20) -> float:
    """Mean microseconds of ``fn()`` over ``iters`` calls after 3 untimed ones."""
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return round((time.perf_counter() - t0) / iters * 1e6, 1)


def decode_kernel_times(cfg, batch: int, device: str) -> dict:
    """One GDN layer's decode step at ``batch`` rows: fp32 vs bf16 state pool (slots 0..B-1), the
    engine's tile (``default``) and a small sweep of (BLOCK_V, num_warps) for the next tuning."""
    from asyncrl.engine.triton_gdn import gated_delta_decode

    HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(batch, HK, K, device=device, generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, HV, V, device=device, generator=g, dtype=torch.bfloat16)
    gate, beta = -torch.rand(batch, HV, device=device, generator=g), torch.rand(batch, HV, device=device, generator=g)
    slots = torch.arange(batch, device=device)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        pool = torch.randn(batch + 1, HV, K, V, device=device, generator=g).to(dtype) * 0.1
        moved = 2 * batch * HV * K * V * dtype.itemsize  # read + write of the named slots
        times = {}
        for block_v, warps in ((0, 4), (16, 4), (32, 4), (64, 4), (64, 8), (128, 8)):
            us = timed_us(lambda: gated_delta_decode(q, k, v, gate, beta, pool, slots, block_v, warps), device)
            name = "default" if block_v == 0 else f"bv{block_v}_w{warps}"
            times[name] = dict(us=us, gb_per_s=round(moved / us / 1e3, 1))
        out[str(dtype).split(".")[1]] = times
    return out


def conv_kernel_times(cfg, batch: int, prompt: int, device: str) -> dict:
    """One GDN layer's prefill conv over ``batch`` prompts of ``prompt`` tokens: the torch conv over
    the padded batch (gather, shifted multiply-adds, scatter back: what the engine ran) vs FLA."""
    from asyncrl.engine.models.gated_delta import causal_conv_packed, causal_conv_varlen, fla_chunk_indices, \
        fla_conv_available

    C = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    W = getattr(cfg, "linear_conv_kernel_dim", 4)
    T = batch * prompt
    x = torch.randn(T, C + 64, device=device, dtype=torch.bfloat16)[:, :C]  # a row-strided view, as in_proj's split
    w = torch.randn(C, W, device=device, dtype=torch.bfloat16)
    state = torch.zeros(batch + 1, C, W - 1, device=device, dtype=torch.bfloat16)
    slots, init = torch.arange(batch, device=device), torch.zeros(batch, dtype=torch.long, device=device)
    lens_np = np.full(batch, prompt)
    lens = torch.from_numpy(lens_np).to(device)
    q_index = torch.arange(T, device=device).view(batch, prompt)
    out_index = torch.arange(T, device=device)
    out = dict(tokens=T, channels=C, torch_us=timed_us(
        lambda: causal_conv_varlen(x[q_index], lens, state, slots, init, w).flatten(0, 1)[out_index], device))
    if fla_conv_available():
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens_np)])).to(device)
        chunks = torch.from_numpy(fla_chunk_indices(lens_np)).to(device)
        out["fla_us"] = timed_us(lambda: causal_conv_packed(x, cu, chunks, state, slots, init, w), device)
    return out


def engine_rows(hf, prompts, params, args, device: str, dtype, result: dict) -> list[dict]:
    """Each row of ``ROWS``: one engine per state dtype (the pool's dtype is fixed at build), the
    conv lever switched on the built engine (prefill runs eagerly: no graph to recapture)."""
    rows = result.setdefault("rows", [])
    for state in dict.fromkeys(s for _, s, _ in ROWS):
        t0 = time.perf_counter()
        llm = LLM(hf, dtype=dtype, device=device, block_size=args.block_size, max_num_seqs=args.batch,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.prompt + args.response + 16,
                  gpu_memory_utilization=args.gpu_memory_utilization, mamba_ssm_cache_dtype=state)
        llm.generate([[1] * 16] * 4, SamplingParams(max_tokens=4, ignore_eos=True))
        startup = round(time.perf_counter() - t0, 1)
        for name, s, conv in ROWS:
            if s != state:
                continue
            set_packed_conv(llm, conv)
            row = dict(row=name, mamba_ssm_cache_dtype=state, fla_conv=conv, engine_startup_s=startup,
                       **run_engine(llm, prompts, params, device))
            outs = llm.generate(prompts[:args.mismatch_seqs], SamplingParams(temperature=1.0, max_tokens=args.response,
                                                                           seed=0, ignore_eos=True))
            with torch.inference_mode():
                row["mismatch_vs_hf"] = mismatch(hf, prompts, outs, args.mismatch_seqs)
            if args.profile and conv and state == "bfloat16":  # both levers on: where the time goes now
                row["profile_ms_per_decode_step"] = profile_steps(llm, prompts, params, device, trace_steps=5, rows=20)
            print(json.dumps(row), flush=True)
            rows.append(row)
            write_json(args.json, result)  # after each row: a later failure keeps the earlier numbers
        free(llm)
    return rows


def table(result: dict) -> str:
    hf = result.get("hf_generate", {}).get("tokens_per_s")
    base = result["rows"][0]["tokens_per_s"]
    lines = [f"workload (a): {result['workload']}; HF generate {hf or '-'} tok/s",
             "row | engine tok/s | x HF | x baseline | mean |log p_engine - log p_HF|"]
    for r in result["rows"]:
        x_hf = f"{r['tokens_per_s'] / hf:.2f}" if hf else "-"
        lines.append(f"{r['row']} | {r['tokens_per_s']:,.0f} | {x_hf} | {r['tokens_per_s'] / base:.2f} | "
                     f"{r['mismatch_vs_hf']['mean_abs']:.2e}")
    k = result.get("kernels", {})
    if k:
        lines.append(f"GDN decode kernel, one layer: {json.dumps(k['decode'])}")
        lines.append(f"prefill conv, one layer: {json.dumps(k['conv'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--mismatch-seqs", type=int, default=16)
    ap.add_argument("--no-hf", action="store_true", help="engine rows only")
    ap.add_argument("--profile", action="store_true", help="with both levers on: per-step phases and the top-20 "
                                                             "CUDA kernels of a prefill and 5 decode steps (~20 s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    engine_bench.WARMUP_RUNS = 1  # run_engine: one untimed run; run_hf: an 8-token warm-up batch
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    hf = build_hf(args.shape, dtype, device, args.prompt + args.response + 16)
    prompts = _rand_prompts(args.batch, args.prompt, hf.config.vocab_size, 1)
    params = SamplingParams(temperature=1.0, max_tokens=args.response, ignore_eos=True)
    result = dict(provenance(" ".join(sys.argv)), shape=args.shape,
                  workload=f"{args.batch} x ({args.prompt} in, {args.response} out), T = 1, EOS ignored")
    if not device.startswith("cuda"):
        result["device"] = "cpu"
    if device.startswith("cuda"):
        result["kernels"] = dict(decode=decode_kernel_times(hf.config, args.batch, device),
                                 conv=conv_kernel_times(hf.config, args.batch, args.prompt, device))
        print("kernels", json.dumps(result["kernels"]), flush=True)
    if not args.no_hf:
        result["hf_generate"] = run_hf(hf, prompts, 1, [args.response] * args.batch, 1.0, args.batch, device)
        print("hf", json.dumps(result["hf_generate"]), flush=True)
    write_json(args.json, result)
    engine_rows(hf, prompts, params, args, device, dtype, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
