"""Issue-4 workload (a) on the new families, engine vs HF ``generate`` in the same run (one GPU).

    python bench/model_families.py --shapes qwen3.5-0.8b --profile        # ~1.5 min on an H200
    python bench/model_families.py --json bench/results/model_families_h200.json   # both shapes

Workload (a): 256 prompts x (256 random tokens in, 256 out, EOS ignored), temperature 1, random
bf16 weights built from configs (no download):
  * ``qwen3.5-0.8b``: a Qwen3.5-0.8B-shaped hybrid (24 layers, 3 Gated DeltaNet : 1 gated attention,
    hidden 1024, 248,320 vocab; the shape is assumed from the model card, not read from a checkpoint);
  * ``qwen3-30b-a3b``: Qwen3-30B-A3B's config numbers (48 layers, 128 experts top-8, hidden 2048).
HF runs the same prompts as one static batch with its best kernels (FLA for the delta rule when
``fla-core`` is installed, ``grouped_mm`` experts). HF's part can be capped (``--hf-prompts``,
``--hf-response``; for MoE shapes ``--moe-hf-prompts`` / ``--moe-hf-response``, on by default:
HF's 30B at batch 256 x 256 takes minutes; ``--moe-hf-prompts 256 --moe-hf-response 256`` runs it
uncapped, and a capped run prints bounds on that time): the engine then also runs that capped workload, and
the speedup is taken at equal size (batch and length), as the output says; the engine's full
workload-(a) number is reported beside it. The 30B model's weights (61 GB) exist once on the GPU at
a time: HF generates first, its weights move to host memory while the engine (a copy) runs, and
come back for the routing check.

``--profile``: after the timed runs, the workload once more step by step (``profile_steps``): host
ms per decode step by phase, prefill time, and torch.profiler's top-20 CUDA kernels of one prefill
step and of 5 decode steps, so one GPU call both measures and explains. A table closes the output.

Routing check (MoE): the engine returns the experts it chose for 8 completions; the HF model
recomputes them without replay (``routing_mismatch``: differing (token, layer) top-k sets, bf16
engine vs bf16 HF) and with replay (``replay_max_logprob_diff`` vs the engine's log-probs).
Needs: torch 2.11+, transformers 5.x, triton, fla-core + einops (prefill kernels).
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

from asyncrl.engine import bench as engine_bench  # noqa: E402
from asyncrl.engine.bench import (_rand_prompts, profile_steps, provenance, run_engine, run_hf,  # noqa: E402
                                  write_json)
from asyncrl.types import SamplingParams  # noqa: E402

SHAPES = {
    "qwen3.5-0.8b": ("Qwen3_5TextConfig", dict(
        vocab_size=248320, hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, intermediate_size=3584, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, tie_word_embeddings=False)),
    # CPU smoke shapes (same code path, seconds)
    "tiny-qwen3.5": ("Qwen3_5TextConfig", dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True)),
    "tiny-moe": ("Qwen3MoeConfig", dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False)),
}


def build_hf(shape: str, dtype, device: str, max_pos: int):
    import transformers
    from transformers import AutoModelForCausalLM

    cls, kw = SHAPES[shape]
    cfg = getattr(transformers, cls)(max_position_embeddings=max_pos, rms_norm_eps=1e-6, eos_token_id=0,
                                     pad_token_id=0, bos_token_id=0, **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _empty():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def routing_check(hf, outs, device) -> dict:
    """Mismatch of the HF model's own routing vs the engine's, and log-probs with replay."""
    from asyncrl.training.batch import build_train_batch
    from asyncrl.training.logprobs import response_logprobs
    from asyncrl.training.routing_replay import RoutingReplay

    batch = build_train_batch(outs, [0.0] * sum(len(o.completions) for o in outs), pad_id=0)
    args = (hf, batch.input_ids.to(device), batch.attention_mask.to(device), batch.prompt_length)
    kw = dict(share_prompts=False, pack_bin_tokens=0)
    mask = batch.response_mask.bool()
    result = {}
    for replay in (False, True):
        hooks = RoutingReplay(hf, replay=replay)
        with hooks.use(batch.routed_experts, batch.routing_mask):
            lp = response_logprobs(*args, **kw)[0].float().cpu()
        diff = (lp - batch.rollout_logprobs)[mask].abs()
        key = "replay" if replay else "native"
        result[f"{key}_max_logprob_diff"] = round(diff.max().item(), 5)
        result[f"{key}_mean_logprob_diff"] = round(diff.mean().item(), 6)
        if not replay:
            result["routing_mismatch"] = round(hooks.mismatch_rate(), 5)
        hooks.remove()
    return result


def is_moe(shape: str) -> bool:
    return "moe" in shape or "a3b" in shape


def hf_size(shape: str, args) -> tuple[int, int]:
    """(prompts, new tokens) HF generates for ``shape``: the workload unless capped."""
    prompts, response = (args.moe_hf_prompts, args.moe_hf_response) if is_moe(shape) else (args.hf_prompts,
                                                                                            args.hf_response)
    return min(prompts or args.batch, args.batch), min(response or args.response, args.response)


def hf_full_estimate(hf: dict, args) -> dict:
    """Bounds on HF generate's time for the uncapped workload from a capped run: ``low`` if a
    step's time did not grow with the batch (launch-bound decode: only the step count scales),
    ``high`` if time grew with the tokens (compute-bound). Run ``--moe-hf-prompts/--moe-hf-response``
    at the workload's size to measure it."""
    steps = args.response / hf["response"]
    return dict(low=round(hf["seconds"] * steps, 1),
                high=round(hf["seconds"] * steps * args.batch / hf["batch"], 1))


def bench_shape(shape: str, args, device: str, dtype) -> dict:
    from asyncrl.engine import LLM

    max_len = args.prompt + args.response + 16
    hf = build_hf(shape, dtype, device, max_len)
    prompts = _rand_prompts(args.batch, args.prompt, hf.config.vocab_size, 1)
    params = SamplingParams(temperature=1.0, max_tokens=args.response, ignore_eos=True)
    result = {"shape": shape, "params_b": round(sum(p.numel() for p in hf.parameters()) / 1e9, 2),
              # which HF experts kernel the baseline ran (transformers 5: grouped_mm unless unavailable)
              "hf_experts_implementation": getattr(hf.config, "_experts_implementation", None)}
    hf_n, hf_out = hf_size(shape, args)
    capped = (hf_n, hf_out) != (args.batch, args.response)
    if not args.no_hf:
        result["hf_generate"] = run_hf(hf, prompts[:hf_n], 1, [hf_out] * hf_n, 1.0, hf_n, device)
        result["hf_generate"].update(batch=hf_n, response=hf_out)
        print(shape, "hf", json.dumps(result["hf_generate"]), flush=True)
    moe = is_moe(shape)
    if moe:  # one copy of the weights on the GPU at a time
        hf.to("cpu")
        _empty()
    t0 = time.perf_counter()
    llm = LLM(hf, dtype=dtype, device=device, block_size=args.block_size, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
              gpu_memory_utilization=args.gpu_memory_utilization,
              return_routed_experts=moe and not args.no_routed_experts)
    llm.generate([[1] * 16] * 4, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up outside the timing
    result["engine_startup_s"] = round(time.perf_counter() - t0, 1)
    result["kv_blocks"] = len(llm.block_manager.blocks)  # x block_size = tokens the KV pool holds
    result["returns_routed_experts"] = llm.config.return_routed_experts
    budget = llm.runner.kv_budget  # GPU: the sizing's numbers (weights, free, headroom), one line
    if budget is not None:
        result["kv_budget"] = budget.line(args.block_size)
        print(shape, result["kv_budget"], flush=True)
    print(shape, "engine startup", result["engine_startup_s"], "s; KV blocks", result["kv_blocks"], "x",
          args.block_size, "tokens", flush=True)
    result["engine"] = run_engine(llm, prompts, params, device)
    print(shape, "engine", json.dumps(result["engine"]), flush=True)
    same = result["engine"]
    if capped:  # the engine at HF's size too: the speedup compares equal batch and length
        same = result["engine_at_hf_size"] = run_engine(
            llm, prompts[:hf_n], SamplingParams(temperature=1.0, max_tokens=hf_out, ignore_eos=True), device)
        print(shape, f"engine at HF's size ({hf_n} x {hf_out} out)", json.dumps(same), flush=True)
    if not args.no_hf and capped:
        result["hf_full_workload_estimate_s"] = hf_full_estimate(result["hf_generate"], args)
        print(shape, "HF on the full workload would take (s, bounds from the capped run):",
              result["hf_full_workload_estimate_s"], flush=True)
    if not args.no_hf:
        result["speedup"] = round(same["tokens_per_s"] / result["hf_generate"]["tokens_per_s"], 2)
        result["speedup_at"] = f"{hf_n} prompts x {hf_out} out" + (" (HF capped)" if capped else "")
        print(shape, "speedup", result["speedup"], "at", result["speedup_at"], flush=True)
    if args.profile:
        result["profile_ms_per_decode_step"] = profile_steps(llm, prompts, params, device, trace_steps=5, rows=20)
        print(shape, "ms per decode step:", json.dumps(result["profile_ms_per_decode_step"]), flush=True)
    if moe and not args.no_routed_experts:
        outs = llm.generate(prompts[:4], SamplingParams(n=2, temperature=1.0, max_tokens=32, seed=0, ignore_eos=True))
        llm.close()
        del llm
        _empty()
        hf.to(device)
        result["routing"] = routing_check(hf, outs, device)
        print(shape, "routing", json.dumps(result["routing"]), flush=True)
    else:
        llm.close()
    del hf
    _empty()
    return result


def summary(results: list[dict]) -> str:
    """The closing table: one row per shape."""
    head = ("shape", "HF size", "HF tok/s", "engine tok/s same size", "speedup", "engine tok/s (a)",
            "decode ms/step", "prefill s", "routing mismatch")
    rows = [head]
    for r in results:
        hf, prof = r.get("hf_generate"), r.get("profile_ms_per_decode_step", {})
        same = r.get("engine_at_hf_size", r["engine"])
        rows.append((r["shape"], f"{hf['batch']} x {hf['response']}" if hf else "-",
                     f"{hf['tokens_per_s']:,.0f}" if hf else "-", f"{same['tokens_per_s']:,.0f}",
                     f"{r['speedup']}x" if "speedup" in r else "-", f"{r['engine']['tokens_per_s']:,.0f}",
                     f"{prof['step']:.2f}" if prof else "-",
                     f"{prof['prefill_ms_total'] / 1000:.2f}" if prof else "-",
                     str(r["routing"]["routing_mismatch"]) if "routing" in r else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3.5-0.8b,qwen3-30b-a3b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--hf-prompts", type=int, default=None, help="HF generates this many prompts (default: all)")
    ap.add_argument("--hf-response", type=int, default=None, help="HF's new tokens (default: --response)")
    ap.add_argument("--moe-hf-prompts", type=int, default=32, help="--hf-prompts for MoE shapes")
    ap.add_argument("--moe-hf-response", type=int, default=64, help="--hf-response for MoE shapes")
    ap.add_argument("--no-hf", action="store_true", help="engine only")
    ap.add_argument("--no-routed-experts", action="store_true",
                    help="MoE: the engine does not return the routed experts (its cost = the run with them "
                         "minus this one); no routing check")
    ap.add_argument("--profile", action="store_true",
                    help="per-step phases and the top-20 CUDA kernels of one prefill and 5 decode steps")
    ap.add_argument("--warmup-runs", type=int, default=1,
                    help="untimed runs of each workload first (Triton/FLA JIT and autotuning, CUDA graph "
                         "buckets, cuBLAS plans; a cold Qwen3.5 run measured 2.9k tok/s against ~24k warm)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine_bench.WARMUP_RUNS = args.warmup_runs  # run_engine / run_hf read the module's setting
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    out = dict(provenance(" ".join(sys.argv)), workload=f"a: {args.batch} x ({args.prompt} in, {args.response} out)",
               warmup_runs=args.warmup_runs, results=[])
    if not args.device.startswith("cuda"):
        out["device"] = "cpu"
    try:
        import fla  # noqa: F401
        out["fla"] = getattr(fla, "__version__", "installed")
    except ImportError:
        out["fla"] = None
    for shape in args.shapes.split(","):
        out["results"].append(bench_shape(shape, args, args.device, dtype))
        write_json(args.json, out)  # after each shape: a later shape's failure keeps the earlier ones
    print(json.dumps(out, indent=1))
    print(summary(out["results"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
