"""The single way to (re)generate the quickstart numbers that README.md and docs/async.md quote.

Runs the quickstart as a newcomer does (``asyncrl train``, a fresh process, an empty warm-start
cache: bench/quickstart_seeds.py's ``run_seed``), sync for each seed and async for the first,
and prints the markdown blocks; ``--write`` also puts them into the docs between their
markers and saves the raw numbers to bench/results/readme_numbers.json, which the CI test
(tests/test_readme_numbers.py) compares with the quickstart run CI makes anyway.

    python bench/readme_numbers.py --write                # seeds 0 1 2 sync + seed 0 async: ~20 min on 2 cores
    python bench/readme_numbers.py --seeds 0 --write      # one seed: ~8 min
    python bench/readme_numbers.py --check                # the docs' blocks match the JSON (no run)
    python bench/readme_numbers.py --render               # re-render the blocks from the JSON (no run)

Seed noise, said how: a seed-0 run elsewhere should gain (after-RL minus warm-start accuracy)
within ``tolerance`` of seed 0's gain, tolerance = max(3 x the standard deviation of the gain over
the seeds run, 3 binomial standard errors of the eval: sqrt(p (1 - p) / n) with n = 200
problems greedy, 800 samples sampled). The gain, not the after-RL accuracy: each seed trains
its own warm start, whose accuracy differs by more than RL's spread.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from quickstart_seeds import run_seed  # noqa: E402  (quickstart_runs.run_train, one cache per seed)

JSON_PATH = ROOT / "bench" / "results" / "readme_numbers.json"
#: mode -> (document, what the block says the command is)
TARGETS = {"sync": (ROOT / "README.md", "asyncrl train"),
           "async": (ROOT / "docs" / "async.md", "asyncrl train runtime.mode=async")}
HELDOUT = 200          # task.num_eval of the quickstart
SAMPLES_PER_PROBLEM = 4  # trainer.eval_samples
START, END = "<!-- readme-numbers:{mode} (written by `python bench/readme_numbers.py --write`; do not edit) -->", \
    "<!-- /readme-numbers:{mode} -->"


def tolerance(values: list[float], p: float, n: int) -> float:
    """max(3 sd over seeds, 3 binomial standard errors of an eval of n draws at accuracy p)."""
    sd = statistics_sd(values)
    return max(3 * sd, 3 * math.sqrt(max(p * (1 - p), 1e-4) / n))


def statistics_sd(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def measure(seeds: list[int], modes: list[str]) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="asyncrl-readme-"))
    load_start = os.getloadavg()[0]  # a busy machine cuts RL short (trainer.max_wall_seconds): said in the block
    runs = {"sync": [], "async": []}
    for mode in modes:
        for seed in seeds if mode == "sync" else seeds[:1]:
            start = time.perf_counter()
            summary = run_seed(seed, [f"runtime.mode={mode}", "logging.report=false"], out_dir / mode)
            print(f"{mode} seed {seed}: {time.perf_counter() - start:.0f} s, run dir {summary['run_dir']} "
                  "(bench/report_screenshots.py takes it)", file=sys.stderr, flush=True)
            runs[mode].append({k: summary[k] for k in ("seed", "steps", "sft_accuracy", "final_accuracy",
                                                       "sft_sampled_accuracy", "final_sampled_accuracy",
                                                       "rl_seconds", "process_seconds")})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"date": date.today().isoformat(), "commit": commit.strip(), "machine": machine(),
            "load_average": round(load_start, 1), "runs": {m: r for m, r in runs.items() if r}}


def machine() -> str:
    return f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs"


def block(mode: str, numbers: dict) -> str:
    """The markdown the docs quote for ``mode``, with its command, machine, date and tolerance."""
    runs = numbers["runs"][mode]
    first = runs[0]
    gains = {k: [r[f"final_{k}"] - r[f"sft_{k}"] for r in runs] for k in ("accuracy", "sampled_accuracy")}
    # on the gain: each seed has its own warm start (seed 2's greedy starts 0.33 above seed 0's), so
    # the spread of after-RL accuracies over seeds says nothing about a seed-0 run elsewhere
    tol = {k: tolerance(gains[k], first[f"final_{k}"], n)
           for k, n in (("accuracy", HELDOUT), ("sampled_accuracy", HELDOUT * SAMPLES_PER_PROBLEM))}
    command = TARGETS[mode][1] + ("" if first["seed"] == 0 else f" seed={first['seed']}")
    lines = [START.format(mode=mode),
             f"`{command}` (seed {first['seed']}, empty warm-start cache), {numbers['machine']}, {numbers['date']}, "
             f"commit {numbers['commit']}: held-out accuracy **sampled {_arrow(first, 'sampled_accuracy')}**, "
             f"greedy {_arrow(first, 'accuracy')}; {first['steps']} RL steps in {first['rl_seconds']:.0f} s, the "
             f"whole job {first['process_seconds'] / 60:.1f} minutes."]
    planned = planned_steps()
    if first["steps"] < planned:
        load = f"; 1-minute load average {numbers['load_average']} at the start" if "load_average" in numbers else ""
        lines.append(f"RL stopped at step {first['steps']} of {planned} at the recipe's `trainer.max_wall_seconds` "
                     f"({first['rl_seconds']:.0f} s{load}): a slower or busier machine makes fewer steps.")
    if len(runs) > 1:
        seeds = ", ".join(str(r["seed"]) for r in runs)
        lines.append(f"Over seeds {seeds}: sampled gain {_points(gains['sampled_accuracy'])}, "
                     f"greedy gain {_points(gains['accuracy'])}.")
    lines.append(f"A seed-0 run elsewhere should gain within ±{100 * tol['sampled_accuracy']:.1f} points (sampled) and "
                 f"±{100 * tol['accuracy']:.1f} points (greedy) of these gains: 3 standard deviations of the gain over "
                 "the seeds run, at least 3 binomial standard errors of the 200-problem eval "
                 "(`tests/test_readme_numbers.py` checks CI's own quickstart run against them).")
    lines.append(END.format(mode=mode))
    return "\n".join(lines)


def planned_steps() -> int:
    """The quickstart recipe's ``trainer.steps``."""
    sys.path.insert(0, str(ROOT))
    from asyncrl.config import load_config

    return load_config("quickstart").trainer.steps


def _arrow(run: dict, key: str) -> str:
    before, after = run[f"sft_{key}"], run[f"final_{key}"]
    return f"{before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points)"


def _points(gains: list[float]) -> str:
    return (f"mean {100 * sum(gains) / len(gains):+.1f} points (min {100 * min(gains):+.1f}, "
            f"max {100 * max(gains):+.1f})")


def replace_block(text: str, mode: str, new: str) -> str:
    pattern = re.compile(re.escape(START.format(mode=mode)) + ".*?" + re.escape(END.format(mode=mode)), re.S)
    if not pattern.search(text):
        raise SystemExit(f"no readme-numbers:{mode} block to replace (add its two marker lines first)")
    return pattern.sub(lambda _: new, text)


def current_block(text: str, mode: str) -> str:
    match = re.search(re.escape(START.format(mode=mode)) + ".*?" + re.escape(END.format(mode=mode)), text, re.S)
    return match.group(0) if match else ""


def check(numbers: dict) -> list[str]:
    """Documents whose block differs from what ``numbers`` renders to (empty: all agree)."""
    return [f"{TARGETS[mode][0].relative_to(ROOT)}: readme-numbers:{mode} block differs from {JSON_PATH.name}"
            for mode in numbers["runs"]
            if current_block(TARGETS[mode][0].read_text(), mode) != block(mode, numbers)]


def write_blocks(numbers: dict) -> None:
    """Each mode's block, rendered from ``numbers``, into its document."""
    for mode in numbers["runs"]:
        path = TARGETS[mode][0]
        path.write_text(replace_block(path.read_text(), mode, block(mode, numbers)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=list(TARGETS))
    parser.add_argument("--write", action="store_true", help="update the docs' blocks and the JSON")
    parser.add_argument("--check", action="store_true", help="only check the docs' blocks against the JSON")
    parser.add_argument("--render", action="store_true",
                        help="only re-render the docs' blocks from the JSON (after a change of this script's wording)")
    args = parser.parse_args()
    if args.check:
        problems = check(json.loads(JSON_PATH.read_text()))
        print("\n".join(problems) or "README.md and docs/async.md quote bench/results/readme_numbers.json")
        return 1 if problems else 0
    if args.render:
        write_blocks(json.loads(JSON_PATH.read_text()))
        return 0
    numbers = measure(args.seeds, args.modes)
    for mode in numbers["runs"]:
        print(block(mode, numbers), end="\n\n")
    if args.write:
        JSON_PATH.write_text(json.dumps(numbers, indent=2) + "\n")
        write_blocks(numbers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
