"""The CPU quickstart with LoRA against full fine-tuning, on the same seeds, warm starts and steps.

For each seed every run starts from the same SFT warm start (the cache is built once per seed,
before the runs, so parallel runs never race on it), then runs the same number of GRPO steps with
the wall-clock cap lifted, so the only difference is what trains: every weight (full, at the
quickstart's lr) or rank-r adapters on every linear (LoRA, at each ``--lora-lrs`` value; LoRA
needs ~10x full fine-tuning's learning rate: Schulman et al., "LoRA Without Regret", 2025).
Prints a markdown table for bench/RESULTS.md and writes the summaries as JSON.

    nice -n 10 python bench/lora_quickstart.py --seeds 0 1 2 --jobs 2 --json bench/results/lora_quickstart.json

``--jobs 2`` runs two trainings at once (each one thread): on a 2-core machine with nothing else
running that halves the wall time without slowing either run much.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def train(seed: int, name: str, overrides: list[str], out_dir: Path) -> dict:
    """One `asyncrl train` run (the quickstart recipe plus ``overrides``); its summary.json."""
    run_dir = out_dir / f"seed{seed}-{name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"seed={seed}", f"logging.run_dir={run_dir}",
           "logging.progress=false", *overrides]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(process_seconds=time.perf_counter() - start, kind=name, seed=seed, run_dir=str(run_dir),
                   **reward_windows(run_dir / "metrics.jsonl"))
    return summary


def reward_windows(metrics_path: Path, width: int = 250) -> dict:
    """Mean training reward (accuracy of the step's 128 samples at T=1) per window of ``width``
    steps: the learning curve, far less noisy than the final held-out eval (each window averages
    32,000 samples, the eval 800)."""
    rewards = [json.loads(line)["reward/mean"] for line in metrics_path.read_text().splitlines() if line.strip()]
    windows = [rewards[i:i + width] for i in range(0, len(rewards), width)]
    return {"reward_windows": [sum(w) / len(w) for w in windows]}


def sampled_gain(r: dict) -> float:
    return 100 * (r["final_sampled_accuracy"] - r["sft_sampled_accuracy"])


def print_row(r: dict) -> None:
    print(f"| {r['seed']} | {r['kind']} | {r['sft_sampled_accuracy']:.3f} -> {r['final_sampled_accuracy']:.3f} | "
          f"{sampled_gain(r):+.1f} | {r['sft_accuracy']:.3f} -> {r['final_accuracy']:.3f} | "
          f"{100 * r['accuracy_gain']:+.1f} | {r['steps']} | {r['rl_seconds']:.0f} | "
          f"{' '.join(f'{w:.3f}' for w in r['reward_windows'])} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1500)  # the quickstart's
    parser.add_argument("--ranks", type=int, nargs="+", default=[16])
    parser.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank, scale 2)")
    parser.add_argument("--full-lr", type=float, default=1e-4)  # the quickstart's
    parser.add_argument("--lora-lrs", type=float, nargs="*", default=[5e-4], help="none: full fine-tuning only")
    parser.add_argument("--no-full", action="store_true", help="LoRA runs only")
    parser.add_argument("--jobs", type=int, default=1, help="trainings at once (one thread each)")
    parser.add_argument("--no-warm", action="store_true", help="the seeds' warm starts are cached already")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    common = [f"trainer.steps={args.steps}", "trainer.max_wall_seconds=1000000", "trainer.eval_every=0"]
    kinds = {} if args.no_full else {"full": [f"actor.lr={args.full_lr}"]}
    for rank in args.ranks:
        for lr in args.lora_lrs:
            alpha = args.alpha if args.alpha is not None else 2 * rank
            kinds[f"lora-r{rank}-lr{lr:g}"] = [f"actor.lr={lr}", f"actor.lora.rank={rank}", f"actor.lora.alpha={alpha}"]
    out_dir = Path(tempfile.mkdtemp(prefix="asyncrl-lora-"))
    print(f"runs in {out_dir}", flush=True)
    for seed in [] if args.no_warm else args.seeds:  # the warm starts, built once (cached): the parallel runs below only read them
        train(seed, "warm", ["trainer.steps=0", "trainer.eval_samples=0"], out_dir)
    print("| seed | trains | sampled acc SFT -> RL | gain | greedy acc SFT -> RL | gain | RL steps | RL s | "
          "train reward per 250 steps |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    jobs = [(seed, name, common + overrides, out_dir) for seed in args.seeds for name, overrides in kinds.items()]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(train, *job) for job in jobs]
        rows = []
        for future in futures:
            rows.append(future.result())
            print_row(rows[-1])
    for name in kinds:
        mine = [r for r in rows if r["kind"] == name]
        gains, greedy = [sampled_gain(r) for r in mine], [100 * r["accuracy_gain"] for r in mine]
        print(f"{name}: sampled gain mean {sum(gains) / len(gains):+.1f} points (min {min(gains):+.1f}), "
              f"greedy gain mean {sum(greedy) / len(greedy):+.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
