"""The CPU tool task learns: held-out accuracy and tool-call rate before/after GRPO over
episodes, for several RL seeds, run one after another.

    python bench/calculator_tool_seeds.py --seeds 0 1 2 3 [--warm-start DIR] [recipe overrides ...]

Each seed runs ``asyncrl train calculator_tool seed=S`` (RL bounded by trainer.max_wall_seconds).
With --warm-start, every seed starts from that SFT checkpoint (model.path) so the seeds differ in
RL only; without it each seed trains its own warm start first. Writes a JSON line per seed to
bench/results/calculator_tool_seeds.jsonl and prints a table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.runtime.pipeline import run_training

KEYS = ("sft_accuracy", "final_accuracy", "sft_sampled_accuracy", "final_sampled_accuracy", "sft_tool_call_rate",
        "final_tool_call_rate", "sft_sampled_tool_call_rate", "final_sampled_tool_call_rate", "steps", "rl_seconds",
        "wall_seconds")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--warm-start", default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "calculator_tool_seeds.jsonl"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    rows = []
    for seed in args.seeds:
        overrides = [f"seed={seed}", "logging.report=false", "logging.progress=false", *args.overrides]
        if args.warm_start:
            overrides.append(f"model.path={args.warm_start}")
        start = time.perf_counter()
        summary = run_training(load_config("calculator_tool", overrides))
        row = {"seed": seed, "warm_start": args.warm_start, **{k: summary.get(k) for k in KEYS},
               "job_seconds": time.perf_counter() - start, "date": time.strftime("%Y-%m-%d %H:%M")}
        rows.append(row)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    print("seed  greedy before->after  sampled before->after  tool-call (greedy) before->after  steps  job s")
    for r in rows:
        print(f"{r['seed']:>4}  {r['sft_accuracy']:.3f} -> {r['final_accuracy']:.3f}      "
              f"{r['sft_sampled_accuracy']:.3f} -> {r['final_sampled_accuracy']:.3f}       "
              f"{r['sft_tool_call_rate']:.3f} -> {r['final_tool_call_rate']:.3f}                 "
              f"{r['steps']:>5}  {r['job_seconds']:.0f}")


if __name__ == "__main__":
    main()
