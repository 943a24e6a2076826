"""FP8 rollout (issue 23): tokens/s with ``quantization="fp8"`` (and with an FP8 KV cache) vs bf16 on
issue 4's workloads a and c, and each engine's mean |log-prob mismatch| against an HF bf16 forward of
its own sampled tokens, in one run.

  rows        bf16; fp8 = FP8 weights (``quantization="fp8"``, ``fp8_scaling="block"``: 128x128 weight
              blocks); fp8_channel = FP8 weights with ``fp8_scaling="channel"`` (per output channel x per
              token, rowwise ``_scaled_mm``); kv_fp8 = the KV cache only in FP8 (``kv_cache_dtype="fp8"``);
              fp8_channel_kv = channel weights and the FP8 KV cache; fp8_kv (``--rows``) = block + KV

  gemm        the engine's four linears at Qwen3-0.6B's shapes, M = 256 (a decode step of workload a)
              and 4,096: bf16 ``F.linear`` vs FP8 block and channel (quantization + GEMM), GPU us per
              call in CUDA graphs (bench/fp8_gemm_sweep.py has the full sweep)
  a           batch 256, prompt 256, response 256, T = 1, EOS ignored (one untimed run first)
  c           nano-vllm's bench: 256 seqs, in/out lengths U[100, 1024], T = 0.6 (one untimed run of its
              first ``--c-warmup-seqs`` first: compiles and captures what the timed run needs)
  update      seconds of one ``update_weights`` of the whole model (FP8: re-quantized on arrival)
  mismatch    the first ``--mismatch-seqs`` completions of workload a: |log p_engine - log p_HF| per
              token (T = 1: the engine returns log-softmax of its logits), HF = the same bf16 weights
              through transformers' forward (the "trainer")

Engines are built one after the other (bf16 first) from the same random-weight Qwen3-0.6B-shaped
bf16 model (HF's initializer, std 0.02); ``--model DIR`` uses a real checkpoint instead.

    python bench/fp8_rollout.py --json bench/results/fp8_rollout_h200.json        # ~2.5-3 min, one H200
    python bench/fp8_rollout.py --workloads a --rows bf16,fp8_channel,fp8_channel_kv --no-gemm  # ~85 s (+~17 s a row)
    python bench/fp8_rollout.py --device cpu --shape tiny --a-batch 8 --c-seqs 8 --c-max 64 --a-len 32  # CPU smoke
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine import LLM  # noqa: E402
from asyncrl.engine.bench import SHAPES, build_random_hf, provenance, workload_c, write_json  # noqa: E402
from asyncrl.engine.models import decoder  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402


ROWS = {  # engine options of each row
    "bf16": {},
    "bf16_torch_kv": {"fused_kv_write": False},                       # bf16, the K/V write in torch (A/B)
    "fp8": {"quantization": "fp8"},                                   # FP8 weights (W8A8 linears)
    "kv_fp8": {"kv_cache_dtype": "fp8"},                              # FP8 KV cache only
    "fp8_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},       # both
    "fp8_channel": {"quantization": "fp8", "fp8_scaling": "channel"},  # per-channel x per-token FP8 weights
    "fp8_channel_kv": {"quantization": "fp8", "fp8_scaling": "channel", "kv_cache_dtype": "fp8"},
    "bf16_folded": {},                                                # the decode layers with FOLD_NORMS forced (below)
    "kv_fp8_folded": {"kv_cache_dtype": "fp8"},
    "bf16_torch_gemm": {},                                            # torch's GEMMs and glue kernels (below)
    "kv_fp8_torch_gemm": {"kv_cache_dtype": "fp8"},
}
# module switches of ``models.decoder`` a row runs under (set while its engine is built, runs and is measured); the
# other rows take the engine's defaults (on Hopper the folded fused GEMMs: ``decoder.TRITON_GEMM`` None)
DECODER_FLAGS = {"bf16_folded": dict(TRITON_GEMM=True, FOLD_NORMS=True),
                 "kv_fp8_folded": dict(TRITON_GEMM=True, FOLD_NORMS=True),
                 "bf16_torch_gemm": dict(TRITON_GEMM=False),
                 "kv_fp8_torch_gemm": dict(TRITON_GEMM=False)}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(llm, prompts, params, device: str, warmup: int = 1, warmup_seqs: int | None = None):
    """(tokens/s of one timed ``generate`` after ``warmup`` untimed ones of the first ``warmup_seqs``
    prompts (None: all), its outputs)."""
    for _ in range(warmup):
        llm.block_manager.set_namespace(llm.block_manager.namespace)  # no prefix-cache hits across runs
        llm.generate(prompts[:warmup_seqs], params if isinstance(params, SamplingParams) else params[:warmup_seqs])
    llm.block_manager.set_namespace(llm.block_manager.namespace)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    return dict(tokens=tokens, seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds, 1)), outs


def timed_update(llm, hf, device: str) -> float:
    """Seconds of one ``update_weights`` with the whole model from the trainer's GPU tensors (FP8
    rows: quantized on arrival), the second of two calls."""
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        llm.update_weights(hf.state_dict().items(), version=llm.version + 1)
        sync(device)
    return round(time.perf_counter() - t0, 4)


@torch.inference_mode()
def mismatch(hf, prompts, outs, seqs: int, batch: int = 8) -> dict:
    """|engine log-prob - HF log-prob| of each sampled token of the first ``seqs`` completions."""
    rows = [(p, o.completions[0]) for p, o in zip(prompts, outs)][:seqs]
    diffs = []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        ids = torch.tensor([p + c.token_ids for p, c in chunk], device=hf.device)  # equal lengths (EOS ignored)
        logits = hf(ids).logits
        for j, (p, c) in enumerate(chunk):
            lp = torch.log_softmax(logits[j, len(p) - 1:-1].float(), -1)
            ref = lp.gather(1, torch.tensor(c.token_ids, device=lp.device)[:, None]).squeeze(1)
            diffs.append((torch.tensor(c.logprobs, device=lp.device) - ref).abs())
        del logits
    d = torch.cat(diffs)
    return dict(tokens=d.numel(), mean_abs=round(d.mean().item(), 6), p99_abs=round(d.quantile(0.99).item(), 6),
                max_abs=round(d.max().item(), 6))


def gemm_times(device: str) -> dict:
    """bf16 vs FP8 block / channel GPU time (us, CUDA graphs) of the 0.6B shape's four linears, M = 256
    and 4,096 (the engine's own paths: ``fp8.fp8_matmul_scaled_mm``, ``fp8_channel.matmul_scaled_mm``)."""
    from fp8_gemm_sweep import SHAPES, graph_us  # bench/ is this script's directory

    from asyncrl.engine import fp8, fp8_channel

    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        bq, bs = fp8.quantize_weight(w, fp8.padded_k(k))
        cq, cs = fp8_channel.quantize_rows(w, fp8_channel.padded_k(k))
        for m in (256, 4096):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bf16 = graph_us(lambda: torch.nn.functional.linear(x, w))
            block = graph_us(lambda: fp8.fp8_matmul_scaled_mm(x, bq, bs))
            channel = graph_us(lambda: fp8_channel.matmul_scaled_mm(x, cq, cs))
            out[f"{name}_m{m}"] = dict(bf16_us=round(bf16, 1), block_us=round(block, 1), channel_us=round(channel, 1),
                                       block_speedup=round(bf16 / block, 2), channel_speedup=round(bf16 / channel, 2))
    return out


def run_row(hf, options: dict, engine: dict, a, c, args) -> dict:
    """One engine: start-up time, workloads a and c, then the mismatch of its workload-a samples."""
    dev = engine["device"]
    t0 = time.perf_counter()
    llm = LLM(hf, gpu_memory_utilization=0.6, block_size=64 if dev.startswith("cuda") else 16, **engine, **options)
    row = dict(startup_s=round(time.perf_counter() - t0, 1))
    workloads = args.workloads.split(",")
    try:
        if "a" in workloads:
            row["a"], outs = timed_generate(llm, *a, dev, args.warmup_runs)
        if "c" in workloads:
            row["c"], _ = timed_generate(llm, *c, dev, args.warmup_runs, args.c_warmup_seqs)
        row["update_weights_s"] = timed_update(llm, hf, dev)
    finally:
        llm.close()
        del llm
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    if "a" in workloads:
        row["mismatch_vs_hf"] = mismatch(hf, a[0], outs, args.mismatch_seqs)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="an HF checkpoint dir instead of random weights")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--a-batch", type=int, default=256)
    ap.add_argument("--a-len", type=int, default=256, help="workload a: prompt and response length")
    ap.add_argument("--c-seqs", type=int, default=256)
    ap.add_argument("--c-max", type=int, default=1024, help="workload c: in/out lengths U[100, this]")
    ap.add_argument("--mismatch-seqs", type=int, default=64)
    ap.add_argument("--warmup-runs", type=int, default=1)
    # the whole workload by default: with only its first 64 sequences warmed, the timed run paid the
    # later batch buckets' first compiles and captures (19.7k vs 23.4k tok/s, H200 2026-12-02 19:0x UTC)
    ap.add_argument("--c-warmup-seqs", type=int, default=256, help="workload c's untimed run: its first this many")
    ap.add_argument("--workloads", default="a,c", help="a, c or a,c (the mismatch needs a)")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--rows", default="bf16,fp8,fp8_channel,kv_fp8,fp8_channel_kv",
                    help=f"engines to run, of {sorted(ROWS)} (bf16 first)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = args.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    max_len = max(2 * args.a_len, 2 * args.c_max) + 64
    if args.model:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(dev).eval()
    else:
        hf = build_random_hf(args.shape, dtype, dev, max_len)
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(1)
    a_prompts = torch.randint(1, vocab, (args.a_batch, args.a_len), generator=g).tolist()
    a_params = SamplingParams(temperature=1.0, max_tokens=args.a_len, ignore_eos=True, logprobs=True, seed=0)
    c_prompts, c_params = workload_c(vocab, args.c_seqs, args.c_max, args.c_max)
    results = dict(provenance(" ".join(sys.argv)), model=args.model or f"random {args.shape} ({dtype})", rows={})
    if not dev.startswith("cuda"):
        results["device"] = "cpu"
    if dev.startswith("cuda") and not args.no_gemm:
        try:
            results["gemm"] = gemm_times(dev)
        except Exception as err:  # noqa: BLE001 - reported, the engine rows still run
            results["gemm"] = dict(error=f"{type(err).__name__}: {err}")
        print("gemm", json.dumps(results["gemm"]), flush=True)
    for name in args.rows.split(","):
        flags = DECODER_FLAGS.get(name, {})
        saved = {k: getattr(decoder, k) for k in flags}
        try:  # one failing row (a kernel this GPU lacks) still leaves the others' numbers
            for k, v in flags.items():
                setattr(decoder, k, v)
            row = run_row(hf, ROWS[name], dict(dtype=dtype, device=dev, max_model_len=max_len),
                          (a_prompts, a_params), (c_prompts, c_params), args)
        except Exception as err:  # noqa: BLE001 - reported in the results, the run goes on
            row = dict(error=f"{type(err).__name__}: {err}")
        finally:
            for k, v in saved.items():
                setattr(decoder, k, v)
        results["rows"][name] = row
        print(name, json.dumps(row), flush=True)
    ok = {name: r for name, r in results["rows"].items() if "error" not in r}
    if "bf16" in ok:
        results["over_bf16"] = {name: {w: round(r[w]["tokens_per_s"] / ok["bf16"][w]["tokens_per_s"], 3)
                                       for w in ("a", "c") if w in r} for name, r in ok.items() if name != "bf16"}
    write_json(args.json, results)
    print(json.dumps({"over_bf16": results.get("over_bf16"),
                      "mean_abs_mismatch": {n: r["mismatch_vs_hf"]["mean_abs"] for n, r in ok.items()
                                            if "mismatch_vs_hf" in r}}), flush=True)
    return 0 if len(ok) == len(results["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
