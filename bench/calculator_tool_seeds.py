"""The CPU tool task learns: held-out accuracy and tool-call rate before/after GRPO over
episodes, for several seeds, each run the way a user runs it, one after another.

    python bench/calculator_tool_seeds.py --seeds 0 1 2 3 [--warm-start DIR] [recipe overrides ...]

Each seed runs ``asyncrl train calculator_tool seed=S`` as a whole job: its own SFT warm start
(in an empty temporary cache, so nothing is reused: the job time includes it), RL bounded by
``trainer.max_wall_seconds``, and the held-out evals before and after. With --warm-start every
seed instead starts from that checkpoint (model.path), so the seeds differ in RL only. Writes a
JSON line per seed (with the 1-minute load average at its start and end: the machine may be
shared) to bench/results/calculator_tool_seeds.jsonl and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.runtime.pipeline import run_training

KEYS = ("sft_accuracy", "final_accuracy", "sft_sampled_accuracy", "final_sampled_accuracy", "sft_tool_call_rate",
        "final_tool_call_rate", "sft_sampled_tool_call_rate", "final_sampled_tool_call_rate", "steps", "rl_seconds",
        "wall_seconds", "sft/seconds")


def run_seed(seed: int, warm_start, overrides: list[str]) -> dict:
    """One whole job; its row of results."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-calculator-") as cache:
        overrides = [f"seed={seed}", "logging.report=false", "logging.progress=false", f"sft.cache_dir={cache}",
                     *overrides] + ([f"model.path={warm_start}"] if warm_start else [])
        load_start, start = os.getloadavg()[0], time.perf_counter()
        summary = run_training(load_config("calculator_tool", overrides))
        return {"seed": seed, "warm_start": warm_start, **{k: summary.get(k) for k in KEYS},
                "job_seconds": time.perf_counter() - start, "load_start": load_start,
                "load_end": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M"), "overrides": overrides}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--warm-start", default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "calculator_tool_seeds.jsonl"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.warm_start, args.overrides))
        with open(args.out, "a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
    print("seed | tool-call greedy | tool-call sampled | acc greedy | acc sampled | steps | job s | load")
    for r in rows:
        pair = lambda k: f"{r['sft_' + k]:.3f} -> {r['final_' + k]:.3f}"
        print(f"{r['seed']} | {pair('tool_call_rate')} | {pair('sampled_tool_call_rate')} | {pair('accuracy')} | "
              f"{pair('sampled_accuracy')} | {r['steps']} | {r['job_seconds']:.0f} | "
              f"{r['load_start']:.1f}-{r['load_end']:.1f}")


if __name__ == "__main__":
    main()
