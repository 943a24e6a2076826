"""Run every algorithm recipe on the quickstart task (same seed, same cached SFT warm start)
and print a markdown table: held-out accuracy SFT -> final, reward early -> late, wall time.

    python bench/recipes_table.py --steps 200 --jobs 4
    python bench/recipes_table.py --recipes grpo dapo --steps 50 --jobs 1

The warm start is trained once (``trainer.steps=0`` on the quickstart recipe, optionally on
another device with --sft-device) into --cache, then every recipe reuses it. Runs with
--jobs > 1 share the machine: their wall times are comparable with each other only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RECIPES = ["grpo", "dr_grpo", "dapo", "gspo", "sapo", "ppo", "rloo", "reinforce_pp"]
WINDOW = 20  # steps averaged for the early / late reward


def train(recipe: str, run_dir: Path, args, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", recipe, f"seed={args.seed}", f"logging.run_dir={run_dir}",
           f"sft.cache_dir={args.cache}", "logging.progress=false", "logging.tensorboard=false",
           f"trainer.torch_threads={args.threads}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)


def row(recipe: str, run_dir: Path, proc: subprocess.CompletedProcess) -> dict:
    if proc.returncode != 0 or not (run_dir / "summary.json").is_file():
        return {"recipe": recipe, "error": f"exit {proc.returncode}, see {run_dir}.log"}
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [json.loads(line)["reward/mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    window = min(WINDOW, max(1, len(rewards) // 2))
    return {"recipe": recipe, "steps": summary["steps"], "sft": summary["sft_accuracy"],
            "final": summary["final_accuracy"], "sft_sampled": summary.get("sft_sampled_accuracy"),
            "final_sampled": summary.get("final_sampled_accuracy"), "reward_early": sum(rewards[:window]) / window,
            "reward_late": sum(rewards[-window:]) / window, "rl_seconds": summary["rl_seconds"],
            "s_per_step": summary["rl_seconds"] / max(1, summary["steps"])}


def markdown(rows: list[dict], window: int = WINDOW) -> str:
    lines = ["| recipe | steps | sampled held-out acc SFT -> final | gain | greedy acc SFT -> final | gain | "
             f"reward first/last {window} steps | RL wall s | s/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | failed: {r['error']} | | | | | | | |")
            continue
        sampled = (f"{r['sft_sampled']:.3f} -> {r['final_sampled']:.3f} | {100 * (r['final_sampled'] - r['sft_sampled']):+.1f}"
                   if r.get("sft_sampled") is not None else "n/a | n/a")
        lines.append(f"| {r['recipe']} | {r['steps']} | {sampled} | {r['sft']:.3f} -> {r['final']:.3f} | "
                     f"{100 * (r['final'] - r['sft']):+.1f} | {r['reward_early']:.3f} -> {r['reward_late']:.3f} | "
                     f"{r['rl_seconds']:.0f} | {r['s_per_step']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="recipes run at once")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--sft-device", default=None, help="device of the one warm-start run (default: --device)")
    parser.add_argument("--cache", default=os.environ.get("ASYNCRL_CACHE", "/tmp/asyncrl_bench_cache"))
    parser.add_argument("--out", default="/tmp/asyncrl_recipes", help="run dirs and logs")
    parser.add_argument("--json", default=None, help="also write the rows as json here")
    parser.add_argument("--max-rl-seconds", type=float, default=None,
                        help="stop each run's RL past this (trainer.max_wall_seconds); the table reports steps done")
    parser.add_argument("--set", nargs="*", default=[], help="extra overrides for every run (key=value)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    warm = train("quickstart", out / "warm_start", args,
                 ["trainer.steps=0", f"trainer.device={args.sft_device or args.device}", *args.set])
    if warm.returncode != 0:
        print(f"warm start failed, see {out / 'warm_start.log'}", file=sys.stderr)
        return 1
    print(f"warm start ready in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    extra = [f"trainer.steps={args.steps}", f"trainer.device={args.device}", *args.set]
    if args.max_rl_seconds:
        extra.append(f"trainer.max_wall_seconds={args.max_rl_seconds}")
    with ThreadPoolExecutor(args.jobs) as pool:
        procs = list(pool.map(lambda r: train(r, out / r, args, extra), args.recipes))
    rows = [row(r, out / r, p) for r, p in zip(args.recipes, procs)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(markdown(rows))
    print(f"\n{len(args.recipes)} recipes, {args.steps} steps, seed {args.seed}, {args.jobs} at once, "
          f"{args.threads} threads each, device {args.device}; total {time.perf_counter() - start:.0f}s")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
