"""The fused actor update with and without this wave's two backward changes, interleaved in one process.

Issue 8's peer shape (16 prompts x 8 samples x (256 + 256), one micro-batch of 128, random Qwen3-0.6B
bf16, the fused plan): the same actor updated under three configurations in rounds, medians per config:

  main                   the key gather's backward by index_select's autograd (bf16 index_add_) and
                         Liger's RMSNorm backward (ASYNCRL_LIGER_RMS_BACKWARD=1)
  slot_gather            varlen_gather's atomic-free backward, Liger's RMSNorm backward
  slot_gather+wide_rms   both changes
  fused_attention        slot_gather+wide_rms with the fused attention (the default since 2026-12-03; the
                         others run with ASYNCRL_FUSED_ATTENTION=0): a second actor, the choice is made
                         when the model is prepared; only with ``--fused-attention``

``--profile`` also prints a torch.profiler kernel table of one default update (with input shapes).

    python bench/trainer_update_ab.py [--rounds 3] [--per-round 3] [--json out.json] [--profile] [--fused-attention]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_speed_gpu import (DEVICE, MICRO_BATCH, PROMPT_TOKENS, PROMPTS, SAMPLES, VOCAB,  # noqa: E402
                               build_actor, build_checkpoint, make_batch, sync)

import asyncrl.training.varlen as varlen  # noqa: E402
from asyncrl.training.varlen_gather import gather_key_slots  # noqa: E402


def _index_select(x, key_index, slots):
    return x.index_select(0, key_index)


CONFIGS = {"main": (_index_select, "1"), "slot_gather": (gather_key_slots, "1"),
           "slot_gather+wide_rms": (gather_key_slots, "0"), "fused_attention": (gather_key_slots, "0")}


def use(name: str) -> None:
    gather, liger = CONFIGS[name]
    varlen.gather_key_slots = gather  # varlen_attention's gather (module global, looked up per call)
    os.environ["ASYNCRL_LIGER_RMS_BACKWARD"] = liger


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--fused-attention", action="store_true", help="also the ASYNCRL_FUSED_ATTENTION=1 actor")
    ap.add_argument("--work-dir", default="/tmp/peer_trl_h200")
    args = ap.parse_args()
    checkpoint = build_checkpoint(Path(args.work_dir) / "qwen3_06b_random_bf16")
    batch = make_batch(PROMPTS, SAMPLES, PROMPT_TOKENS, 256, VOCAB, DEVICE)
    os.environ["ASYNCRL_FUSED_ATTENTION"] = "0"  # the first four configurations: HF's attention module
    actors = {"main": build_actor(checkpoint, "fused", MICRO_BATCH)}
    if args.fused_attention:
        os.environ["ASYNCRL_FUSED_ATTENTION"] = "1"
        actors["fused_attention"] = build_actor(checkpoint, "fused", MICRO_BATCH)
    os.environ.pop("ASYNCRL_FUSED_ATTENTION")
    configs = [name for name in CONFIGS if name != "fused_attention" or args.fused_attention]
    seconds = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name in configs:
            use(name)
            actor = actors.get(name, actors["main"])
            actor.update(batch)  # warm-up of this configuration
            for _ in range(args.per_round):
                sync()
                t0 = time.perf_counter()
                actor.update(batch)
                sync()
                seconds[name].append(time.perf_counter() - t0)
    out = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
           "plans": {name: actor.plan.describe() for name, actor in actors.items()},
           "median_s": {k: round(statistics.median(v), 4) for k, v in seconds.items()},
           "runs": {k: [round(x, 4) for x in v] for k, v in seconds.items()}}
    print(json.dumps(out["median_s"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    for name in ("slot_gather+wide_rms", "fused_attention") if args.profile else ():
        if name not in configs:
            continue
        use(name)
        actor = actors.get(name, actors["main"])
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                              if DEVICE == "cuda" else [])
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            actor.update(batch)
            sync()
        key = "self_device_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
        print(f"== profile: {name}")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=45))


if __name__ == "__main__":
    main()
