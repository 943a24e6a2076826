"""Run the CPU quickstart (`asyncrl train`) for several seeds, each as a new user would.

Each seed runs in a fresh process with an empty warm-start cache, so the wall time
includes the SFT warm start. Prints a markdown table for bench/RESULTS.md and writes
the per-seed summaries as JSON.

    python bench/quickstart_seeds.py --seeds 0 1 2 3 --json bench/results/quickstart_seeds.json
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


def run_seed(seed: int, extra: list[str], out_dir: Path) -> dict:
    run_dir = out_dir / f"seed{seed}"
    env = {**os.environ, "ASYNCRL_CACHE": str(out_dir / f"cache{seed}")}  # no warm start reuse
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"seed={seed}", f"logging.run_dir={run_dir}",
           "logging.progress=false", *extra]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["process_seconds"] = time.perf_counter() - start
    return summary


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="asyncrl-seeds-"))
    rows = [run_seed(seed, args.overrides, out_dir) for seed in args.seeds]
    print("| seed | sampled acc SFT -> RL | gain | greedy acc SFT -> RL | gain | RL steps | RL s | total s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['sft_sampled_accuracy']:.3f} -> {r['final_sampled_accuracy']:.3f} | "
              f"{100 * (r['final_sampled_accuracy'] - r['sft_sampled_accuracy']):+.1f} | "
              f"{r['sft_accuracy']:.3f} -> {r['final_accuracy']:.3f} | {100 * r['accuracy_gain']:+.1f} | "
              f"{r['steps']} | {r['rl_seconds']:.0f} | {r['process_seconds']:.0f} |")
    for name, key in (("sampled", "sampled_accuracy"), ("greedy", "accuracy")):
        gains = [100 * (r[f"final_{key}"] - r[f"sft_{key}"]) for r in rows]
        print(f"{name}: mean gain {sum(gains) / len(gains):+.1f} points, min {min(gains):+.1f}")
    print(f"max total {max(r['process_seconds'] for r in rows):.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
