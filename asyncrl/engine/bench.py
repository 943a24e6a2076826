"""Rollout throughput benchmark: the engine vs HF ``generate`` in the same run.

Workloads (sizes configurable so it also runs small on a CPU):
  a  batch B, prompt P, response R, EOS ignored (default 256/256/256)
  b  GRPO-shaped: G prompts x n samples, prompt P, response R (32 x 16, 1024, 128),
     engine with prefix sharing (fork + prefix cache) on and off
  c  nano-vllm's bench.py: N seqs, input and output lengths uniform in [100, max]
     drawn with Python ``random.seed(0)`` in nano-vllm's order, temperature 0.6

tokens/s counts generated tokens over wall time of the whole call (prefill included).
HF generate runs static batches (padded, every row to the batch's max length); for
workloads b and c it runs on the first ``--hf-max-seqs`` / ``--hf-c-seqs`` sequences (a subset), and its
tokens/s counts only the tokens each request asked for.

    python -m asyncrl.engine.bench --shape qwen3-0.6b --json out.json
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from asyncrl.types import SamplingParams

SHAPES = {
    # Qwen3-0.6B's config.json numbers
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    # CPU-sized but with a vocabulary the training samples cannot cover (as 0.6B's 152k): whether a
    # trained draft head generalises to tokens it never saw (bench/spec_eagle.py)
    "mini-32k": dict(vocab_size=32768, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}


def build_random_hf(shape: str, dtype: torch.dtype, device: str, max_pos: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(max_position_embeddings=max_pos, rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=0,
                      bos_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


WARMUP_RUNS = 0  # set from --warmup-runs


def run_engine(llm, prompts, params, device) -> dict:
    """Timed ``generate`` of the workload; first ``WARMUP_RUNS`` untimed runs of it (the
    first run of a shape pays kernel-plan / allocator / compile costs: 32.5k vs 44k tok/s
    on workload a, bench/RESULTS.md). The prefix cache is emptied before each run."""
    for _ in range(WARMUP_RUNS):
        llm.block_manager.set_namespace(llm.block_manager.namespace)
        llm.generate(prompts, params)
    llm.block_manager.set_namespace(llm.block_manager.namespace)
    _sync(device)
    m0 = dict(llm.metrics)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(device)
    dt = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    m1 = llm.metrics
    return dict(tokens=tokens, seconds=round(dt, 3), tokens_per_s=round(tokens / dt, 1),
                prefill_tokens=m1["prefill_tokens"] - m0["prefill_tokens"],
                prefix_cache_hit_tokens=m1["prefix_cache_hit_tokens"] - m0["prefix_cache_hit_tokens"],
                forked_prompt_tokens=m1["forked_prompt_tokens"] - m0["forked_prompt_tokens"],
                preemptions=m1["preemptions"] - m0["preemptions"], steps=m1["steps"] - m0["steps"])


@torch.inference_mode()
def run_hf(hf, prompts: list[list[int]], n: int, max_tokens: list[int], temperature: float, batch: int,
           device: str) -> dict:
    """Static-batch HF generate (sampling, EOS ignored via min_new_tokens)."""
    jobs = [(p, m) for p, m in zip(prompts, max_tokens) for _ in range(n)]
    if WARMUP_RUNS:  # like the engine: first-call costs (cuBLAS plans, allocator) outside the timing
        _hf_generate(hf, jobs[:batch], 8, temperature, device)
    _sync(device)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(jobs), batch):
        chunk = jobs[i:i + batch]
        _hf_generate(hf, chunk, max(m for _, m in chunk), temperature, device)
        tokens += sum(m for _, m in chunk)
    _sync(device)
    dt = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # give HF's cached blocks back before the next engine sizes its KV pool
    return dict(tokens=tokens, seconds=round(dt, 3), tokens_per_s=round(tokens / dt, 1), sequences=len(jobs))


def _hf_generate(hf, chunk, new: int, temperature: float, device: str) -> None:
    """One left-padded static batch through ``generate``, exactly ``new`` tokens per row."""
    width = max(len(p) for p, _ in chunk)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
    hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)


def nano_workload(num_seqs: int, max_in: int, max_out: int):
    """nano-vllm bench.py's requests, same RNG call order."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_in))] for _ in range(num_seqs)]
    outs = [random.randint(100, max_out) for _ in range(num_seqs)]
    return prompts, outs


def _rand_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (num, length), generator=g).tolist()


def workload_a(vocab: int, batch: int = 256, prompt: int = 256, response: int = 256):
    """Workload a: ``batch`` random prompts of ``prompt`` tokens, ``response`` tokens each at T = 1:
    (prompts, SamplingParams)."""
    return (_rand_prompts(batch, prompt, vocab, 1),
            SamplingParams(temperature=1.0, max_tokens=response, ignore_eos=True))


def workload_c(vocab: int, seqs: int = 256, max_in: int = 1024, max_out: int = 1024):
    """Workload c: nano-vllm's requests (``nano_workload``, ids folded into ``vocab``) at T = 0.6, each
    with its own output length: (prompts, [SamplingParams])."""
    prompts, outs = nano_workload(seqs, max_in, max_out)
    return ([[t % vocab for t in p] for p in prompts],
            [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in outs])


def interleaved_ab(build, variants: dict, loads: dict, repeats: int, device: str = "cuda") -> dict:
    """Engine A/B: one engine per variant, all held at once, timed in interleaved repeats.

    ``variants``: name -> ``apply()``, a no-argument callable that switches the engine code to that
    variant (a module flag or rule) and is called before the variant's engine is built (so its CUDA
    graphs capture the variant) and before each of its timed runs (eager paths read it then too).
    ``build()`` -> an ``LLM``: a fresh one per variant, or the same one where the variants only
    switch code that runs outside the graphs; ``loads``: workload name -> (prompts, params). Each engine runs
    every workload once untimed first (plans, compiles), then each repeat times every (workload,
    variant) in turn. The first variant is the baseline. Returns {workload: {tokens_per_s: {name:
    [runs]}, median: {name: tok/s}, over_baseline: {name: ratio}}}."""
    engines = {}
    for name, apply in variants.items():
        apply()
        llm = build()
        for prompts, params in loads.values():
            llm.generate(prompts, params)
        engines[name] = llm
    runs = {w: {name: [] for name in engines} for w in loads}
    try:
        for _ in range(repeats):
            for w, (prompts, params) in loads.items():
                for name, llm in engines.items():
                    variants[name]()
                    r = run_engine(llm, prompts, params, device)
                    runs[w][name].append(r["tokens_per_s"])
                    print(w, name, r["tokens_per_s"], "preemptions", r["preemptions"], flush=True)
    finally:
        for llm in {id(e): e for e in engines.values()}.values():
            _free(llm)
    base = next(iter(variants))
    out = {}
    for w, by in runs.items():
        med = {name: statistics.median(v) for name, v in by.items()}
        out[w] = dict(tokens_per_s=by, median=med,
                      over_baseline={n: round(m / med[base], 3) for n, m in med.items() if n != base})
        print(w, json.dumps(out[w]), flush=True)
    return out


def workloads_ab(variants: dict, kv_dtypes: list[str], blocks: int, repeats: int) -> dict:
    """``interleaved_ab`` of workloads (a) and (c) on the random-weight qwen3-0.6b in bf16 (CUDA), once per KV-cache
    dtype in ``kv_dtypes`` ("bf16" or "fp8"): one engine per variant with a fixed pool of ``blocks`` KV blocks of
    64 tokens (every variant's engine is held at once). Returns {kv dtype: interleaved_ab's result}."""
    from asyncrl.engine import LLM

    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", 4096)
    kw = dict(dtype=torch.bfloat16, device="cuda", block_size=64, max_num_seqs=512, max_num_batched_tokens=16384,
              max_model_len=4096, num_kv_blocks=blocks)
    vocab = hf.config.vocab_size
    loads = {"a": workload_a(vocab), "c": workload_c(vocab)}
    out = {}
    for kv in kv_dtypes:
        print("kv", kv, flush=True)
        fp8 = {"kv_cache_dtype": "fp8"} if kv == "fp8" else {}
        out[kv] = interleaved_ab(lambda: LLM(hf, **kw, **fp8), variants, loads, repeats)
    return out


def provenance(command: str) -> dict:
    """The head of a bench result file: date (UTC), device, torch version and the command that made it."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), device=device, torch=torch.__version__,
                command=command)


def write_json(path: str | None, out: dict) -> None:
    """``out`` as indented JSON at ``path``; nothing when ``path`` is None (no ``--json``)."""
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)


def _free(llm) -> None:
    llm.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile_steps(llm, prompts, params, device: str, trace_steps: int = 8, rows: int = 18) -> dict:
    """Host time per decode step of the engine loop, phase by phase, in the order
    ``LLM.step`` runs them: schedule step t, launch it (inputs + enqueue, no wait), wait for
    step t-1's tokens (``fetch``: the device still computing), postprocess them. With
    overlapped scheduling the wait absorbs the device time; without it each step waits for
    itself. Also torch.profiler tables (``rows`` lines) of one prefill step and of
    ``trace_steps`` decode steps."""
    for p in prompts:
        llm.add_request(p, params)
    phases = dict(schedule=0.0, launch=0.0, wait=0.0, postprocess=0.0, step=0.0)
    decode_steps, prof, prefill_s, prefill_steps = 0, None, 0.0, 0
    sc, runner = llm.scheduler, llm.runner
    inflight = None
    while not sc.is_finished() or inflight is not None:
        t0 = time.perf_counter()
        batch = sc.schedule()
        t1 = time.perf_counter()
        if batch is not None and prof is None and (prefill_steps == 1 if batch.is_prefill else decode_steps == 20):
            # one prefill step (the second: warm), or trace_steps decode steps after 20
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        launched = (batch, runner.launch(batch)) if batch is not None else None
        t2 = time.perf_counter()
        if not llm.async_scheduling and launched is not None:
            inflight, launched = launched, None
        tokens, logprobs = runner.fetch(inflight[1]) if inflight is not None else ([], [])
        t3 = time.perf_counter()
        if inflight is not None:
            sc.postprocess(inflight[0], tokens, logprobs, llm.version)
        inflight = launched
        t4 = time.perf_counter()
        if batch is None or batch.is_prefill:
            prefill_s += t4 - t0
            prefill_steps += batch is not None
            if prof and prefill_steps == 2:
                _sync(device)
                prof.__exit__(None, None, None)
                print("prefill step:", prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows))
                prof = None
            continue
        decode_steps += 1
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            phases[k] += v
        if prof is not None and decode_steps == 20 + trace_steps:
            prof.__exit__(None, None, None)
            print(f"{trace_steps} decode steps:", prof.key_averages().table(sort_by="self_device_time_total",
                                                                              row_limit=rows), flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
            prof = False
    llm._requests.clear()
    return {k: round(v / max(decode_steps, 1) * 1000, 3) for k, v in phases.items()} | {
        "decode_steps": decode_steps, "prefill_steps": prefill_steps, "prefill_ms_total": round(prefill_s * 1000, 1),
        "async_scheduling": llm.async_scheduling}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="asyncrl bench rollout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="random-weight model shape")
    ap.add_argument("--model", default=None, help="HF checkpoint dir instead of a random model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default) | float32 (CPU default)")
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--a-batch", type=int, default=None)
    ap.add_argument("--a-prompt", type=int, default=None)
    ap.add_argument("--a-response", type=int, default=None)
    ap.add_argument("--b-prompts", type=int, default=None)
    ap.add_argument("--b-samples", type=int, default=None)
    ap.add_argument("--b-prompt", type=int, default=None)
    ap.add_argument("--b-response", type=int, default=None)
    ap.add_argument("--c-seqs", type=int, default=None)
    ap.add_argument("--c-max-in", type=int, default=None)
    ap.add_argument("--c-max-out", type=int, default=None)
    ap.add_argument("--hf-batch", type=int, default=None, help="HF generate static batch size")
    ap.add_argument("--hf-max-seqs", type=int, default=None, help="HF runs on at most this many sequences")
    ap.add_argument("--hf-c-seqs", type=int, default=None,
                    help="HF runs workload c on this many sequences (static batches run to the longest)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-compile-sampler", action="store_true")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default=None, choices=("fp8",), help="engine: FP8 linears (engine/fp8_linear.py)")
    ap.add_argument("--fp8-scaling", default="block", choices=("block", "channel"),
                    help="engine + --quantization fp8: 128x128 weight blocks, or per output channel x per token")
    ap.add_argument("--kv-cache-dtype", default=None, choices=("fp8",), help="engine: FP8 KV cache")
    ap.add_argument("--warmup-runs", type=int, default=0,
                    help="untimed engine runs of each workload before the timed one (steady state)")
    ap.add_argument("--compare-async", action="store_true",
                    help="workloads a and c also without overlapped scheduling, same engine, same run")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="read each step's tokens before scheduling the next (no host/device overlap)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                    help="engine's share of GPU memory (the rest leaves room for the HF baseline)")
    ap.add_argument("--profile", action="store_true", help="phase timings + torch.profiler of workload a, then exit")
    ap.add_argument("--also-profile", action="store_true", help="--profile after the workloads, same engine")
    ap.add_argument("--profile-rows", type=int, default=18, help="lines of the --profile kernel tables")
    ap.add_argument("--profile-workload", default="a", choices=("a", "b"),
                    help="what --profile / --also-profile run: workload a, or b's G prompts x n samples "
                         "(prefix sharing on: the GRPO rollout's decode, cascade attention included)")
    ap.add_argument("--no-cascade", action="store_true", help="plain paged decode even where rows share a prefix")
    ap.add_argument("--torch-kv-write", action="store_true",
                    help="EngineConfig.fused_kv_write=False: q/k norm + RoPE and the K/V cache write in five kernels "
                         "(the default on a GPU is one Triton kernel)")
    ap.add_argument("--json", default=None, help="write results to this path")
    ap.add_argument("--cpu-quickstart", action="store_true",
                    help="only the CPU quickstart's rollout (engine vs HF generate, bench_quickstart.py)")
    ap.add_argument("--qs-repeats", type=int, default=40, help="rollouts per backend for --cpu-quickstart")
    ap.add_argument("--random-weights", action="store_true",
                    help="--cpu-quickstart on the quickstart model before SFT (default: the SFT warm start)")
    return size_for_device(ap.parse_args(argv))


#: Workload sizes when no flag sets them: a GPU's (the numbers in bench/RESULTS.md), and a
#: CPU's, which finish in about a minute on two cores instead of hours.
GPU_SIZES = dict(shape="qwen3-0.6b", a_batch=256, a_prompt=256, a_response=256, b_prompts=32, b_samples=16,
                 b_prompt=1024, b_response=128, c_seqs=256, c_max_in=1024, c_max_out=1024, hf_batch=256,
                 hf_max_seqs=256, hf_c_seqs=64, max_model_len=4096)
CPU_SIZES = dict(shape="tiny", a_batch=32, a_prompt=64, a_response=64, b_prompts=4, b_samples=8, b_prompt=128,
                 b_response=32, c_seqs=32, c_max_in=128, c_max_out=128, hf_batch=32, hf_max_seqs=32, hf_c_seqs=16,
                 max_model_len=512)


def size_for_device(args):
    """Fill every sizing flag left unset from the device's sizes (GPU_SIZES / CPU_SIZES)."""
    sizes = GPU_SIZES if args.device.startswith("cuda") else CPU_SIZES
    args.sized_for = "GPU" if sizes is GPU_SIZES else "CPU"
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    global WARMUP_RUNS
    WARMUP_RUNS = args.warmup_runs
    if args.cpu_quickstart:
        return _quickstart(args, argv)
    from asyncrl.engine import LLM

    dev = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev.startswith("cuda") else torch.float32)
    block = args.block_size or (64 if dev.startswith("cuda") else 16)
    if args.model:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(dev).eval()
    else:
        hf = build_random_hf(args.shape, dtype, dev, args.max_model_len)
    vocab = hf.config.vocab_size
    engine_kw = dict(dtype=dtype, device=dev, block_size=block, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                     enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
                     compile_sampler=not args.no_compile_sampler,
                     async_scheduling=False if args.no_async_scheduling else None,
                     quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                     fp8_scaling=args.fp8_scaling, cascade_attention=not args.no_cascade,
                     fused_kv_write=False if args.torch_kv_write else None)

    def make_llm(**kw):
        t0 = time.perf_counter()
        llm = LLM(hf, **{**engine_kw, **kw})
        # warm-up: Triton/compile caches and allocator, outside the timed runs
        llm.generate([[1] * 16] * 4, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
        return llm, round(time.perf_counter() - t0, 1)

    results = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), command="asyncrl bench rollout " + " ".join(argv or []),
                   device=torch.cuda.get_device_name() if dev.startswith("cuda") else platform.processor() or "cpu",
                   torch=torch.__version__, model=args.model or f"random {args.shape}", dtype=str(dtype),
                   quantization=args.quantization, fp8_scaling=args.fp8_scaling, kv_cache_dtype=args.kv_cache_dtype,
                   block_size=block, workloads={})
    wl = set(args.workloads.split(","))
    print(f"asyncrl bench rollout on {results['device']}: {results['model']}, workloads {','.join(sorted(wl))} "
          f"sized for a {args.sized_for} (a: {args.a_batch} x {args.a_prompt}+{args.a_response} tokens; "
          f"flags override, see --help); building the engine...", flush=True)
    llm, startup = make_llm()
    results["engine_startup_s"] = startup

    if args.profile:
        print("ms per decode step:", json.dumps(profile_steps(llm, *_profiled(args, vocab), dev, rows=args.profile_rows)), flush=True)
        return 0
    results["async_scheduling"] = llm.async_scheduling

    if "a" in wl:
        print("workload a: running...", flush=True)
        prompts, params = workload_a(vocab, args.a_batch, args.a_prompt, args.a_response)
        r = dict(engine=run_engine(llm, prompts, params, dev), **_no_overlap(llm, prompts, params, dev, args))
        if not args.no_hf:
            k = min(args.hf_max_seqs, len(prompts))
            r["hf_generate"] = run_hf(hf, prompts[:k], 1, [args.a_response] * k, 1.0, args.hf_batch, dev)
            r["speedup"] = round(r["engine"]["tokens_per_s"] / r["hf_generate"]["tokens_per_s"], 2)
        results["workloads"]["a"] = r
        print("a", json.dumps(r), flush=True)

    if "b" in wl:
        print("workload b: running...", flush=True)
        prompts = _rand_prompts(args.b_prompts, args.b_prompt, vocab, 2)
        params = SamplingParams(n=args.b_samples, temperature=1.0, max_tokens=args.b_response, ignore_eos=True)
        r = dict(sharing_on=run_engine(llm, prompts, params, dev))
        _free(llm)
        llm = None
        off, _ = make_llm(enable_fork=False, enable_prefix_caching=False)
        r["sharing_off"] = run_engine(off, prompts, params, dev)
        _free(off)
        r["sharing_speedup"] = round(r["sharing_on"]["tokens_per_s"] / r["sharing_off"]["tokens_per_s"], 2)
        if not args.no_hf:
            k = max(1, min(args.hf_max_seqs // args.b_samples, len(prompts)))
            r["hf_generate"] = run_hf(hf, prompts[:k], args.b_samples, [args.b_response] * k, 1.0, args.hf_batch, dev)
            r["speedup"] = round(r["sharing_on"]["tokens_per_s"] / r["hf_generate"]["tokens_per_s"], 2)
        results["workloads"]["b"] = r
        print("b", json.dumps(r), flush=True)

    if "c" in wl:
        print("workload c: running...", flush=True)
        if llm is None:
            llm, _ = make_llm()
        prompts, params = workload_c(vocab, args.c_seqs, args.c_max_in, args.c_max_out)
        outs = [p.max_tokens for p in params]
        r = dict(engine=run_engine(llm, prompts, params, dev), **_no_overlap(llm, prompts, params, dev, args))
        if not args.no_hf:
            k = min(args.hf_c_seqs, len(prompts))
            r["hf_generate"] = run_hf(hf, prompts[:k], 1, outs[:k], 0.6, args.hf_batch, dev)
            r["speedup"] = round(r["engine"]["tokens_per_s"] / r["hf_generate"]["tokens_per_s"], 2)
        results["workloads"]["c"] = r
        print("c", json.dumps(r), flush=True)

    if args.also_profile:
        if llm is None:
            llm, _ = make_llm()
        llm.block_manager.set_namespace(llm.block_manager.namespace)  # no prefix-cache hits
        key = f"profile_{args.profile_workload}_ms_per_decode_step"
        results[key] = profile_steps(llm, *_profiled(args, vocab), dev, rows=args.profile_rows)
        print("ms per decode step:", json.dumps(results[key]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    return 0


def _profiled(args, vocab: int) -> tuple[list[list[int]], SamplingParams]:
    """The prompts and sampling params ``--profile`` runs: workload a's, or b's (n samples each)."""
    if args.profile_workload == "b":
        return (_rand_prompts(args.b_prompts, args.b_prompt, vocab, 2),
                SamplingParams(n=args.b_samples, temperature=1.0, max_tokens=args.b_response, ignore_eos=True))
    return workload_a(vocab, args.a_batch, args.a_prompt, args.a_response)


def _no_overlap(llm, prompts, params, dev, args) -> dict:
    """With ``--compare-async``: the same workload on the same engine, step by step."""
    if not args.compare_async or not llm.async_scheduling:
        return {}
    llm.async_scheduling = False  # safe between generate calls: nothing is in flight
    try:
        r = run_engine(llm, prompts, params, dev)
    finally:
        llm.async_scheduling = True
    return {"engine_no_overlap": r}


def _quickstart(args, argv) -> int:
    from asyncrl.engine.bench_quickstart import run_quickstart_rollout

    r = run_quickstart_rollout(args.qs_repeats, args.random_weights)
    r.update(date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
             command="asyncrl bench rollout " + " ".join(argv or []), torch=torch.__version__,
             device=platform.processor() or "cpu")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
