"""Where the actor update's time goes on a GPU, at issue 8's H200 setting.

The 0.6B-shaped Qwen3 (random weights, bf16, bench/peer_trl_h200.py's checkpoint), one GRPO
batch of 16 prompts x 8 responses, prompt 256 + response 256 tokens, token-mean loss: times
``Actor.update`` (CUDA-synchronised, median of repeats) for several micro-batch sizes, with the
prompt shared per group and not, and prints a torch.profiler table of one update (CUDA kernels
and host time), so the stage breakdown of the peer benchmark can be explained.

    python bench/actor_update_gpu.py --json out.json [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def make_batch(prompts: int, samples: int, prompt_len: int, response_len: int, vocab: int, device):
    from asyncrl.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab - 2, (prompts, prompt_len), generator=g).repeat_interleave(samples, 0)
    response = torch.randint(1, vocab - 2, (prompts * samples, response_len), generator=g)
    B = prompts * samples
    ids = torch.cat([prompt, response], 1)
    mask = torch.ones_like(ids)
    rmask = torch.ones(B, response_len)
    adv = torch.randn(B, 1).expand(B, response_len).contiguous()
    return TrainBatch(input_ids=ids.to(device), attention_mask=mask.to(device), response_mask=rmask.to(device),
                      prompt_length=prompt_len, rollout_logprobs=-torch.rand(B, response_len, device=device) * 10,
                      token_versions=torch.zeros(B, response_len, dtype=torch.long, device=device),
                      scores=torch.rand(B, device=device), group_ids=torch.arange(prompts).repeat_interleave(samples),
                      advantages=adv.to(device))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a dry run with PEER_TRL_TINY=1


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_updates(actor, batch, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        actor.update(batch)
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro", default="32,64,128")
    ap.add_argument("--checkpoint", default="/tmp/peer_trl_h200/model")
    args = ap.parse_args()

    from peer_trl_h200 import NEW_TOKENS, PROMPT_TOKENS, PROMPTS, SAMPLES, VOCAB, build_checkpoint

    from asyncrl.config import load_config
    from asyncrl.training import logprobs as lp
    from asyncrl.training.actor import Actor
    from asyncrl.training.model import load_policy

    ckpt = build_checkpoint(Path(args.checkpoint))
    cfg = load_config("quickstart", [f"model.path={ckpt}", "model.dtype=bfloat16", "actor.lr=1e-6"])
    model, _ = load_policy(cfg.model.path, cfg.model.dtype, DEVICE)
    print("attention implementation:", getattr(model.config, "_attn_implementation", None), flush=True)
    batch = make_batch(PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS, VOCAB, DEVICE)
    results = []
    original = lp.response_logprobs
    for share in (True, False):
        for micro in [int(x) for x in args.micro.split(",")]:
            cfg.actor.micro_batch_size = micro
            actor = Actor(model, cfg.actor, cfg.algorithm, cfg.rollout.temperature)
            lp_fn = original if share else (lambda *a, **k: original(*a, **{**k, "share_prompts": False}))
            import asyncrl.training.actor as actor_mod
            actor_mod.response_logprobs = lp_fn
            try:
                timed_updates(actor, batch, 1)  # warm-up (allocator, cuBLAS plans)
                times = timed_updates(actor, batch, args.repeats)
            except torch.OutOfMemoryError as exc:
                results.append({"share_prompts": share, "micro_batch": micro, "error": "OOM"})
                print(f"share={share} micro={micro}: OOM ({str(exc)[:80]})", flush=True)
                torch.cuda.empty_cache()
                continue
            finally:
                actor_mod.response_logprobs = original
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row = {"share_prompts": share, "micro_batch": micro, "seconds": times,
                   "median_s": statistics.median(times), "peak_gib": peak}
            results.append(row)
            print(f"share={share} micro={micro}: {row['median_s']:.3f} s/update (peak {peak:.1f} GiB)", flush=True)
    cfg.actor.micro_batch_size = 64
    actor = Actor(model, cfg.actor, cfg.algorithm, cfg.rollout.temperature)
    timed_updates(actor, batch, 1)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_updates(actor, batch, 1)
    table_cuda = prof.key_averages().table(sort_by="cuda_time_total" if DEVICE == "cuda" else "cpu_time_total", row_limit=25)
    table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    print(table_cuda)
    print(table_cpu)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                                               "rows": results, "profile_cuda": table_cuda,
                                               "profile_cpu": table_cpu}, indent=1))


if __name__ == "__main__":
    main()
