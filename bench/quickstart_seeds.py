"""Run the CPU quickstart (`asyncrl train`) for several seeds, each as a new user would.

Each seed runs in a fresh process with an empty warm-start cache, so the wall time
includes the SFT warm start. Prints a markdown table for bench/RESULTS.md and writes
the per-seed summaries as JSON.

    python bench/quickstart_seeds.py --seeds 0 1 2 3 --json bench/results/quickstart_seeds.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from quickstart_runs import accuracy_cells, gain_points, run_train, write_json


def run_seed(seed: int, extra: list[str], out_dir: Path) -> dict:
    """The quickstart of ``seed`` with an empty warm-start cache of its own (no warm start reuse)."""
    return run_train(seed, out_dir / f"seed{seed}", out_dir / f"cache{seed}", extra)


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
        print(f"| {r['seed']} | {accuracy_cells(r)} | {r['steps']} | {r['rl_seconds']:.0f} | {r['process_seconds']:.0f} |")
    for name, key in (("sampled", "sampled_accuracy"), ("greedy", "accuracy")):
        gains = [gain_points(r, key) for r in rows]
        print(f"{name}: mean gain {sum(gains) / len(gains):+.1f} points, min {min(gains):+.1f}")
    print(f"max total {max(r['process_seconds'] for r in rows):.0f} s")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
