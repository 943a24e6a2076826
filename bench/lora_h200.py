"""A GRPO step at the Qwen3-8B shape: LoRA rank 32 (all linear layers) against full fine-tuning.

Random bf16 weights built from the config on the GPU (no download). Each kind builds the
colocated pieces a sync run has: the engine (its own copy of the base; LoRA: plus the adapter
slots, served unmerged, CUDA-graph decode on), the actor (AdamW over what trains), then times
each step's three stages, CUDA-synchronised:

    rollout  engine.generate: P prompts x n samples, R new tokens each (ignore_eos)
    update   Actor.update on a batch of that shape (prompt + response tokens, token-mean GRPO loss)
    sync     backend.update_weights(what a sync moves): every weight (full) or A and B (LoRA)

and reports s/step (the median of the timed steps), peak GPU memory over the steps
(``torch.cuda.max_memory_allocated``), the sync's time and bytes, and the probe's log-prob gap
(engine vs trainer after the sync, bf16: a LoRA path that dropped the adapter shows a gap of
about the update's delta). Full fine-tuning runs with ``actor.offload=optimizer`` (fp32 master
weights on the GPU, Adam moments in pinned host memory), as the issue asks; an OOM is reported
as such, not hidden.

    python bench/lora_h200.py --json bench/results/lora_h200.json        # ~90 s on one H200
    python bench/lora_h200.py --tiny                                      # CPU dry run of the code path
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from quickstart_runs import write_json

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)
TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: dict, device, dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=dtype)
    return model


def make_batch(prompts, outputs, prompt_len, response_len, device):
    """The GRPO batch of the generated tokens (random group-normalised advantages)."""
    from asyncrl.types import TrainBatch

    rows = [(p, c) for p, out in zip(prompts, outputs) for c in out.completions]
    B = len(rows)
    ids = torch.tensor([p + (c.token_ids + [0] * response_len)[:response_len] for p, c in rows], device=device)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(B, 1, generator=g).expand(B, response_len).contiguous().to(device)
    logprobs = torch.tensor([(c.logprobs + [0.0] * response_len)[:response_len] for _, c in rows], device=device)
    n = len(outputs[0].completions)
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(B, response_len,
                      device=device), prompt_length=prompt_len, rollout_logprobs=logprobs,
                      token_versions=torch.zeros(B, response_len, dtype=torch.long, device=device),
                      scores=torch.rand(B, device=device), group_ids=torch.arange(len(prompts)).repeat_interleave(n),
                      advantages=adv)


def run_kind(kind: str, model, args, device, dtype) -> dict:
    from asyncrl.config import load_config
    from asyncrl.rollout.engine_backend import EngineBackend
    from asyncrl.runtime.weight_sync import LogprobProbe, rollout_weights
    from asyncrl.training.actor import Actor
    from asyncrl.training.lora import apply_lora, trainable_parameters
    from asyncrl.types import SamplingParams

    lora = kind == "lora"
    overrides = [f"actor.micro_batch_size={args.micro}", "algorithm.decoupled=false",
                 f"actor.lr={args.lora_lr if lora else args.full_lr}"]
    if lora:
        overrides += [f"actor.lora.rank={args.rank}", f"actor.lora.alpha={2 * args.rank}"]
    else:  # fp32 masters + fp32 Adam moments of 8B params (96 GB) beside the engine: moments to the host
        overrides += ["actor.offload=optimizer"]
    cfg = load_config("quickstart", overrides)
    policy = apply_lora(model, cfg.actor.lora) if lora else model.requires_grad_(True)  # PEFT froze the base
    out = {"kind": kind, "trainable_params": sum(p.numel() for p in trainable_parameters(policy))}
    torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
    backend = EngineBackend(policy, None, dtype=dtype, device=str(device), num_kv_blocks=args.kv_blocks,
                            max_num_seqs=args.prompts * args.n, max_model_len=args.prompt_len + args.response_len + 64)
    actor = Actor(policy, cfg.actor, cfg.algorithm, 1.0)
    g = torch.Generator().manual_seed(0)
    vocab = policy.config.vocab_size
    prompts = [torch.randint(10, vocab - 10, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.response_len, ignore_eos=True, logprobs=True)
    probe = LogprobProbe(prompts[0][:32], temperature=1.0, tolerance=float("inf"), max_tokens=8)
    steps = []
    for step in range(1, args.warmup + args.steps + 1):
        t0 = time.perf_counter()
        outputs = backend.generate(prompts, params)
        sync_device(device)
        t1 = time.perf_counter()
        actor.update(make_batch(prompts, outputs, args.prompt_len, args.response_len, device))
        sync_device(device)
        t2 = time.perf_counter()
        tensors = rollout_weights(policy, backend)
        backend.update_weights(tensors, step)
        sync_device(device)
        t3 = time.perf_counter()
        steps.append({"rollout_s": t1 - t0, "update_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0,
                      "sync_bytes": sum(t.numel() * t.element_size() for _, t in tensors)})
        print(f"{kind} step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in steps[-1].items()), flush=True)
    timed = steps[args.warmup:]
    for key in ("step_s", "rollout_s", "update_s", "sync_s"):
        out[key] = statistics.median(s[key] for s in timed)
    out["sync_bytes"] = timed[-1]["sync_bytes"]
    out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    out["probe_gap"] = probe.check(backend, policy, backend.version).gap
    del backend, actor
    if lora:
        policy.unload()  # the base model without adapter layers, for the next kind
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU dry run)")
    parser.add_argument("--kinds", nargs="+", default=["lora", "full"])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=384)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--full-lr", type=float, default=1e-6)
    parser.add_argument("--lora-lr", type=float, default=1e-5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build_model(TINY if args.tiny else QWEN3_8B, device, dtype)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, {dtype}, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for kind in args.kinds:
        try:
            rows.append(run_kind(kind, model, args, device, dtype))
        except torch.OutOfMemoryError as err:  # full fine-tuning without offload may not fit: say so
            rows.append({"kind": kind, "error": f"CUDA out of memory: {str(err).splitlines()[0]}"})
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    print("| kind | trainable | s/step | rollout s | update s | sync s | sync bytes | peak GiB | probe gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | {r['error']} |")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"| {r['kind']} | {r['trainable_params'] / 1e6:.1f} M | {r['step_s']:.2f} | {r['rollout_s']:.2f} | "
              f"{r['update_s']:.2f} | {r['sync_s']:.4f} | {r['sync_bytes'] / 2 ** 20:.1f} MiB | {peak} | "
              f"{r['probe_gap']:.3f} |")
    print(f"total {time.perf_counter() - t0:.0f} s")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
