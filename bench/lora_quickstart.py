"""The CPU quickstart with LoRA against full fine-tuning, on the same seeds, warm starts and steps.

For each seed both runs share one SFT warm start (the same cache dir: the second run loads what
the first built), then run the same number of GRPO steps with no wall-clock cap, so the only
difference is what trains: every weight (full) or rank-r adapters on every linear (LoRA, at the
learning rate LoRA needs, 10x full fine-tuning's: Schulman et al. "LoRA Without Regret", 2025).
Prints a markdown table for bench/RESULTS.md and writes the summaries as JSON.

    nice -n 10 python bench/lora_quickstart.py --seeds 0 1 --steps 400 --json bench/results/lora_quickstart.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(seed: int, name: str, overrides: list[str], out_dir: Path) -> dict:
    run_dir = out_dir / f"seed{seed}-{name}"
    env = {**os.environ, "ASYNCRL_CACHE": str(out_dir / f"cache{seed}")}  # shared by both runs of a seed
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"seed={seed}", f"logging.run_dir={run_dir}",
           "logging.progress=false", *overrides]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(process_seconds=time.perf_counter() - start, kind=name)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--full-lr", type=float, default=1e-4)  # the quickstart's
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    common = [f"trainer.steps={args.steps}", "trainer.max_wall_seconds=1000000", "trainer.eval_every=0"]
    kinds = {"full": [f"actor.lr={args.full_lr}"],
             f"lora-r{args.rank}": [f"actor.lr={args.lora_lr}", f"actor.lora.rank={args.rank}",
                                    f"actor.lora.alpha={2 * args.rank}"]}
    out_dir = Path(tempfile.mkdtemp(prefix="asyncrl-lora-"))
    rows = []
    for seed in args.seeds:
        for name, overrides in kinds.items():
            rows.append(run(seed, name, common + overrides, out_dir))
            r = rows[-1]
            print(f"seed {seed} {name}: sampled {r['sft_sampled_accuracy']:.3f} -> {r['final_sampled_accuracy']:.3f}, "
                  f"greedy {r['sft_accuracy']:.3f} -> {r['final_accuracy']:.3f}, RL {r['rl_seconds']:.0f} s", flush=True)
    print("| seed | trains | sampled acc SFT -> RL | gain | greedy acc SFT -> RL | gain | RL steps | RL s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['kind']} | {r['sft_sampled_accuracy']:.3f} -> {r['final_sampled_accuracy']:.3f} | "
              f"{100 * (r['final_sampled_accuracy'] - r['sft_sampled_accuracy']):+.1f} | "
              f"{r['sft_accuracy']:.3f} -> {r['final_accuracy']:.3f} | {100 * r['accuracy_gain']:+.1f} | "
              f"{r['steps']} | {r['rl_seconds']:.0f} |")
    for name in kinds:
        gains = [100 * (r["final_sampled_accuracy"] - r["sft_sampled_accuracy"]) for r in rows if r["kind"] == name]
        print(f"{name}: sampled mean gain {sum(gains) / len(gains):+.1f} points, min {min(gains):+.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
