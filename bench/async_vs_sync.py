"""Sync vs async on the same recipe and the same number of samples, in one run.

    python bench/async_vs_sync.py --steps 40 [--executors local ray] [--max-staleness 1] [--json out.json]

For each mode it runs ``asyncrl train`` (same seed, same SFT warm start from the cache) for
``--steps`` steps of ``prompts_per_step × n`` samples and reads the RL wall time of the steps.

    overlap bound = (T_rollout + T_train) / max(T_rollout, T_train)   from the sync run's stages
                    (T_rollout = rollout + reward stages, T_train = every other stage)
    speedup       = sync step time / async step time   (per-step medians: shared machines stall
                    single steps for seconds, which would swamp means)
    efficiency    = speedup / bound   (the issue asks for >= 0.9)

Reward per sample consumed is written for both modes (a plot too when matplotlib exists).
The machine matters: on a shared 2-core CPU both loops compete for the same cores, so the
bound assumes resources that are not there; say so next to any number.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.runtime.pipeline import run_training

DECOUPLED = ["algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]


def run(mode: str, executor: str, args, out_dir: Path) -> dict:
    name = f"{mode}_{executor}" if mode == "async" else "sync"
    overrides = [f"trainer.steps={args.steps}", "logging.progress=false", "logging.tensorboard=false",
                 f"logging.run_dir={out_dir / name}", f"task.num_eval={args.num_eval}", *args.overrides]
    if mode == "async":
        overrides += ["runtime.mode=async", f"runtime.executor={executor}",
                      f"runtime.max_staleness={args.max_staleness}", *DECOUPLED]
    else:
        overrides += DECOUPLED if args.sync_decoupled else []
    cfg = load_config(args.recipe, overrides)
    start = time.perf_counter()
    summary = run_training(cfg)
    rows = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    samples = cfg.trainer.prompts_per_step * cfg.rollout.n
    step_s = statistics.median(r["time/step"] for r in rows)  # median: robust to steps stalled by other jobs
    result = {"name": name, "steps": summary["steps"], "step_seconds": step_s, "samples_per_second": samples / step_s,
              "mean_step_seconds": summary["step_wall_seconds"] / max(summary["steps"], 1),
              "rollout_seconds_median": statistics.median(r["time/rollout"] + r["time/reward"] for r in rows),
              "run_seconds": time.perf_counter() - start, "sft_accuracy": summary["sft_accuracy"],
              "final_accuracy": summary["final_accuracy"], "stage_seconds": summary["stage_seconds"],
              "reward_per_samples": [(r["step"] * samples, r["reward/mean"]) for r in rows]}
    if mode == "async":
        result["overlap_mean"] = sum(r["async/overlap"] for r in rows) / len(rows)
        result["staleness_violations"] = sum(r["async/staleness_violations"] for r in rows)
        result["staleness_mean"] = sum(r["async/staleness_mean"] for r in rows) / len(rows)
    return result


def overlap_bound(sync: dict) -> tuple[float, float, float]:
    """Per-step medians of the sync run: T_rollout (rollout + reward stages), T_train (the rest)."""
    rollout = sync["rollout_seconds_median"]
    train = sync["step_seconds"] - rollout
    return rollout, train, (rollout + train) / max(rollout, train, 1e-12)


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        xs, ys = zip(*r["reward_per_samples"])
        ax.plot(xs, ys, label=r["name"])
    ax.set_xlabel("samples consumed")
    ax.set_ylabel("reward/mean")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="quickstart")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--executors", nargs="+", default=["local"], choices=["local", "ray"])
    parser.add_argument("--num-eval", type=int, default=50)
    parser.add_argument("--sync-decoupled", action="store_true", help="the sync run uses the same decoupled loss")
    parser.add_argument("--out", default="/tmp/asyncrl_bench_async_vs_sync")
    parser.add_argument("--json", default=None)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = parser.parse_args()
    out_dir = Path(args.out)
    results = [run("sync", "local", args, out_dir)] + [run("async", e, args, out_dir) for e in args.executors]
    sync = results[0]
    t_roll, t_train, bound = overlap_bound(sync)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "args": vars(args),
              "sync_T_rollout_s": t_roll, "sync_T_train_s": t_train, "overlap_bound": bound, "runs": []}
    print(f"sync (per-step medians): T_rollout {t_roll:.3f}s, T_train {t_train:.3f}s -> overlap bound {bound:.2f}x")
    for r in results:
        speedup = sync["step_seconds"] / r["step_seconds"]
        row = {**{k: v for k, v in r.items() if k != "reward_per_samples"}, "speedup": speedup,
               "efficiency": speedup / bound}
        report["runs"].append({**row, "reward_per_samples": r["reward_per_samples"]})
        print(f"{r['name']:>12}: {r['step_seconds']:.3f} s/step, {r['samples_per_second']:.1f} samples/s, "
              f"speedup {speedup:.2f}x = {speedup / bound:.2f} of the bound, accuracy "
              f"{r['sft_accuracy']:.3f} -> {r['final_accuracy']:.3f}"
              + (f", overlap {r['overlap_mean']:.2f}, violations {r['staleness_violations']:.0f}"
                 if "overlap_mean" in r else ""))
    if plot(results, out_dir / "reward_per_sample.png"):
        print(f"plot: {out_dir / 'reward_per_sample.png'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
