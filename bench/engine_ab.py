"""TP=1 engine throughput of this tree against a base tree, in one run (issue 16: tensor
parallelism must leave the single-GPU engine exactly as fast as before).

    git -C /work/main archive <base-commit> asyncrl | (mkdir -p .ab_base && tar -x -C .ab_base)
    python bench/engine_ab.py --base .ab_base --json bench/results/tp1_ab_h200.json      # a, b, c: ~3-4 min
    python bench/engine_ab.py --base .ab_base --workloads a,b,c --warmup-runs 0 \
        --json bench/results/tp1_ab_h200.json                                               # ~2 min

Each side runs ``bench/bench_rollout.py --warmup-runs W --no-hf`` (issue 4's workloads a, b, c;
the harness of its own tree, unchanged by issue 16) in a fresh process whose PYTHONPATH is its
tree, alternating base, new, base, new ... ``--repeats`` times, so drift on the machine hits
both sides. Prints engine tokens/s per workload and side, and new / base.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METRICS = {"a": ("engine",), "b_on": ("sharing_on",), "b_off": ("sharing_off",), "c": ("engine",)}


def run_side(tree: Path, workloads: str, warmup_runs: int, extra: list[str]) -> dict[str, float]:
    """tokens/s per workload of one bench_rollout run on ``tree``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, str(ROOT / "bench" / "bench_rollout.py"), "--warmup-runs", str(warmup_runs), "--no-hf",
               "--workloads", workloads, "--json", out.name, *extra]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        result = json.load(open(out.name))["workloads"]
    rates = {}
    for name, (key,) in METRICS.items():
        workload = result.get(name[0])
        if workload is not None and key in workload:
            rates[name] = workload[key]["tokens_per_s"]
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="directory holding the base tree's asyncrl package")
    ap.add_argument("--new", default=str(ROOT), help="directory holding this tree's asyncrl package")
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup-runs", type=int, default=1, help="untimed runs of each workload first (each side)")
    ap.add_argument("--json", default=None)
    args, extra = ap.parse_known_args(argv)
    runs = {"base": [], "new": []}
    for _ in range(args.repeats):
        for side in ("base", "new"):
            runs[side].append(run_side(Path(getattr(args, side)).resolve(), args.workloads, args.warmup_runs, extra))
            print(side, json.dumps(runs[side][-1]), flush=True)
    table = {}
    for name in METRICS:
        base = [r[name] for r in runs["base"] if name in r]
        new = [r[name] for r in runs["new"] if name in r]
        if base and new:
            table[name] = {"base": statistics.median(base), "new": statistics.median(new),
                           "new_over_base": statistics.median(new) / statistics.median(base)}
            print(f"{name:6s} base {table[name]['base']:10.0f}  new {table[name]['new']:10.0f} tok/s  "
                  f"new/base {table[name]['new_over_base']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median": table, "argv": argv or sys.argv[1:]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
