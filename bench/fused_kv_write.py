"""The GRPO-shaped decode with ``EngineConfig.fused_kv_write`` off and on (issue 20): tokens/s, ms per
decode step, the per-layer kernels the fused write replaces, and how close the two engines' numbers are.

    python bench/fused_kv_write.py --json bench/results/fused_kv_write_h200.json   # ~1.5-2 min on one H200

Workload and engine as ``asyncrl bench rollout --workloads b --b-prompts 16 --b-samples 8 --b-prompt 256
--b-response 256 --no-hf --warmup-runs 1 --also-profile --profile-workload b`` (``--torch-kv-write`` for
the first side): the qwen3-0.6b shape with random weights, bf16, CUDA graphs, cascade attention, prefix
sharing (bench/peer_trl_h200.py's rollout), built from bench.py's own helpers in ONE process (one HF
model, one engine per side, no sharing-off engine), sides alternating off, on, off, on (``--repeats``).

Printed per side: workload b's tokens/s (timed run after one warm-up run), the host ms per decode step
of ``profile_steps`` (with overlapped scheduling it waits on the device: the device's step time) and,
from torch.profiler's table of 8 decode steps, the rows of the kernels in question: off,
``index_elementwise_kernel`` (store_kv's two ``index_copy_``), the compiled ``_qkv_prepare``'s
``triton_per_fused_..._cat_index_mean_mul_neg...`` and ``v.contiguous()``'s
``triton_poi_fused_clone_split_with_sizes_view``; on, ``_qkv_cache_kernel`` (28 layers x 8 steps = 224
calls) and none of the others. Then ``agreement``: 16 prompts x 64 greedy tokens on both engines, the
share of completions whose tokens are identical and the largest log-prob gap over their common prefix
(bf16: a rounding flip may change a greedy token; tests/engine/test_triton_qkv.py checks fp32 against HF).

    python bench/fused_kv_write.py --offline   # no GPU: compile the kernel for sm90, print its registers
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from pathlib import Path

import torch

from asyncrl.engine import LLM, bench
from asyncrl.types import SamplingParams

KERNELS = re.compile(r"index_elementwise|_qkv_cache_kernel|cat_index_mean|clone_split|index_copy")
SHAPE = dict(b_prompts=16, b_samples=8, b_prompt=256, b_response=256)
DEVICE = "cuda"


def engine(hf, fused: bool) -> LLM:
    # 2048 blocks of 64 tokens (15 GB): workload b needs ~1100 with its prompts shared; a fixed pool, since
    # sizing from free memory would leave the second engine only what the first one left over
    llm = LLM(hf, dtype=torch.bfloat16, device=DEVICE, block_size=64, max_num_seqs=512, max_model_len=4096,
              num_kv_blocks=2048, fused_kv_write=fused)
    assert all(a.fused_kv_write == fused for a in llm.runner._attention_layers())
    llm.generate([[1] * 16] * 4, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))  # warm-up
    return llm


def measure(llm, vocab: int) -> dict:
    """Workload b timed (after one warm-up run), then 8 profiled decode steps of it."""
    args = argparse.Namespace(profile_workload="b", **SHAPE)
    prompts, params = bench._profiled(args, vocab)
    bench.WARMUP_RUNS = 1
    timed = bench.run_engine(llm, prompts, params, DEVICE)
    llm.block_manager.set_namespace(llm.block_manager.namespace)
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        profile = bench.profile_steps(llm, prompts, params, DEVICE)
    decode_table = table.getvalue().split("decode steps:", 1)[-1]
    return dict(tokens_per_s=timed["tokens_per_s"], step_ms=profile["step"], profile=profile,
                kernel_rows=[line.strip() for line in decode_table.splitlines() if KERNELS.search(line)],
                table=decode_table)


def agreement(off: LLM, on: LLM, vocab: int) -> dict:
    prompts = bench._rand_prompts(16, 200, vocab, 7)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    a, b = off.generate(prompts, greedy), on.generate(prompts, greedy)
    same, gap = 0, 0.0
    for x, y in zip(a, b):
        tx, ty = x.completions[0].token_ids, y.completions[0].token_ids
        same += tx == ty
        n = next((i for i, (p, q) in enumerate(zip(tx, ty)) if p != q), len(tx))
        lp = torch.tensor(x.completions[0].logprobs[:n + 1]) - torch.tensor(y.completions[0].logprobs[:n + 1])
        gap = max(gap, lp.abs().max().item())
    return dict(identical_completions=f"{same}/{len(prompts)}", max_logprob_gap=round(gap, 4))


def offline() -> None:
    """``_qkv_cache_kernel`` compiled for sm90 (bf16 and e4m3 caches, Qwen3-0.6B's heads): registers,
    spills (LOCAL), instructions of the PTX."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sm90_offline import compile_sm90, register_usage

    from asyncrl.engine.triton_qkv import _qkv_cache_kernel as kernel

    for cache in ("bf16", "fp8e4nv"):
        ptrs = dict(QKV="*bf16", POS="*i64", COS="*fp32", SIN="*fp32", QW="*bf16", KW="*bf16", Q="*bf16",
                    KC=f"*{cache}", VC=f"*{cache}", SLOT="*i64")
        consts = dict(H=16, HKV=8, D=128, HALF=64, BLOCK_HALF=64, NORM=True, FP8=cache != "bf16", FP8_MAX=448.0)
        sig = {a: ptrs.get(a, "constexpr" if a in consts else ("fp32" if a == "eps" else "i32"))
               for a in kernel.arg_names}
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if sig[a].startswith("*")}
        compiled = compile_sm90(kernel, sig, consts, attrs, num_warps=1, num_stages=1)
        ptx = compiled.asm["ptx"]
        print(f"{cache:8s} {register_usage(compiled)}  ptx lines {len(ptx.splitlines())}, "
              f"shared {compiled.metadata.shared} B")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="off/on rounds (each a timed workload b per side)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--offline", action="store_true", help="compile for sm90 only (no GPU needed)")
    args = ap.parse_args(argv)
    if args.offline:
        offline()
        return 0
    hf = bench.build_random_hf("qwen3-0.6b", torch.bfloat16, DEVICE, 4096)
    vocab = hf.config.vocab_size
    engines = {name: engine(hf, name == "on") for name in ("off", "on")}
    runs: dict[str, list] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            runs[name].append(measure(llm, vocab))
            r = runs[name][-1]
            print(f"fused_kv_write {name}: {r['tokens_per_s']:.0f} tok/s (workload b), "
                  f"{r['step_ms']} ms per decode step", flush=True)
            for row in r["kernel_rows"]:
                print("   ", row, flush=True)
    best = {name: max(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    step = {name: min(r["step_ms"] for r in rs) for name, rs in runs.items()}
    summary = dict(tokens_per_s=best, step_ms=step, speedup=round(best["on"] / best["off"], 3),
                   step_ms_saved=round(step["off"] - step["on"], 3),
                   agreement=agreement(engines["off"], engines["on"], vocab))
    print(json.dumps(summary), flush=True)
    print("decode-step profile, fused on:", runs["on"][-1]["table"])
    if args.json:
        for rs in runs.values():
            for r in rs:
                r.pop("table")
        Path(args.json).write_text(json.dumps(dict(summary=summary, runs=runs, command=" ".join(sys.argv)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
