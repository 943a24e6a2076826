"""Rollout benchmark (engine vs HF generate). See ``asyncrl/engine/bench.py`` for workloads.

    python bench/bench_rollout.py --json bench/results/rollout_h200.json
    python bench/bench_rollout.py --shape tiny --device cpu --a-batch 16 ...   # small, CPU
"""
import sys

from asyncrl.engine.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
