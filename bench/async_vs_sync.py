"""Sync vs async on the same recipe, the same loss and the same number of samples, in one run.

    OMP_NUM_THREADS=1 python bench/async_vs_sync.py --steps 150 --repeats 2 \
        [--async-runs process thread ray] [--max-staleness 1] [--json out.json] [overrides...]

Each repeat runs ``asyncrl train`` once per mode, interleaved (sync, then each async run), same
seed and the same cached SFT warm start, ``--steps`` steps of ``prompts_per_step × n`` samples.
Every run uses decoupled PPO (the quickstart recipe's loss; forced here for any recipe), so
sync and async optimise the same objective; with one optimizer step per batch neither runs a
π_prox forward (actor.py: ``needs_recomputed_old_logprobs``).

async runs: ``process`` = local executor, rollout engine in its own OS process
(``runtime.rollout_process=true``); ``thread`` = the same in a thread of the trainer's
process; ``ray`` = rollout and rewards in Ray actors.

    overlap bound = (T_rollout + T_train) / max(T_rollout, T_train)   from the sync run of the
                    same repeat (T_rollout = rollout + reward stages, T_train = the other stages)
    speedup       = sync s/step / async s/step   (per-step medians: a shared machine stalls
                    single steps for seconds, which would swamp means)
    efficiency    = speedup / bound   (the issue asks for >= 0.9)

Reward per sample consumed is written for every run, and plotted (moving average) when
matplotlib exists.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.runtime.pipeline import run_training

DECOUPLED = ["algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]
ASYNC = {"process": ["runtime.executor=local", "runtime.rollout_process=true"],
         "thread": ["runtime.executor=local", "runtime.rollout_process=false"],
         "ray": ["runtime.executor=ray"]}


def run(name: str, args, out_dir: Path) -> dict:
    """One ``asyncrl train`` run; ``name`` is "sync" or an ``ASYNC`` key."""
    run_dir = out_dir / name
    overrides = [f"trainer.steps={args.steps}", "logging.progress=false", "logging.tensorboard=false",
                 "logging.report=false", f"logging.run_dir={run_dir}", f"task.num_eval={args.num_eval}",
                 "trainer.max_wall_seconds=null", "trainer.eval_every=0", *DECOUPLED, *args.overrides]
    if name != "sync":
        overrides += ["runtime.mode=async", f"runtime.max_staleness={args.max_staleness}", *ASYNC[name]]
    cfg = load_config(args.recipe, overrides)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    summary = run_training(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = cfg.trainer.prompts_per_step * cfg.rollout.n
    step_s = statistics.median(r["time/step"] for r in rows)
    result = {"name": name, "steps": summary["steps"], "step_seconds": step_s, "samples_per_second": samples / step_s,
              "mean_step_seconds": summary["step_wall_seconds"] / max(summary["steps"], 1),
              "rollout_seconds_median": statistics.median(r["time/rollout"] + r["time/reward"] for r in rows),
              "stage_medians": {k[5:]: statistics.median(r[k] for r in rows) for k in rows[0] if k.startswith("time/")},
              "run_seconds": time.perf_counter() - start, "load_before": load, "load_after": os.getloadavg()[0],
              "sft_accuracy": summary["sft_accuracy"], "final_accuracy": summary["final_accuracy"],
              "sft_sampled_accuracy": summary["sft_sampled_accuracy"],
              "final_sampled_accuracy": summary["final_sampled_accuracy"],
              "reward_per_samples": [(r["step"] * samples, r["reward/mean"]) for r in rows]}
    if name != "sync":
        for key in ("async/overlap", "async/staleness_mean", "async/rollout_seconds", "async/trainer_busy_seconds"):
            result[key.split("/")[1] + "_median"] = statistics.median(r[key] for r in rows)
        result["staleness_violations"] = sum(r["async/staleness_violations"] for r in rows)
    return result


def overlap_bound(sync: dict) -> tuple[float, float, float]:
    """Per-step medians of the sync run: T_rollout (rollout + reward stages), T_train (the rest)."""
    rollout = sync["rollout_seconds_median"]
    train = sync["step_seconds"] - rollout
    return rollout, train, (rollout + train) / max(rollout, train, 1e-12)


def plot(runs: list[dict], path: Path, window: int = 20) -> bool:
    """Reward per sample consumed, one curve per distinct reward sequence (runs with identical
    sequences, e.g. the deterministic sync repeats, share a curve and a label)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    curves: dict[tuple, list[str]] = {}
    for r in runs:
        curves.setdefault(tuple(map(tuple, r["reward_per_samples"])), []).append(f"{r['name']}" + (
            f" r{r['repeat']}" if "repeat" in r else ""))
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for points, labels in curves.items():
        xs, ys = zip(*points)
        smooth = [statistics.fmean(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, label=", ".join(labels), lw=1.2)
    ax.set_xlabel("samples consumed")
    ax.set_ylabel(f"reward/mean ({window}-step moving average)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def curves_from(run_dirs: list[str]) -> list[dict]:
    """``reward_per_samples`` of finished runs (their metrics.jsonl and config.yaml)."""
    import yaml

    runs = []
    for run_dir in map(Path, run_dirs):
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        samples = cfg["trainer"]["prompts_per_step"] * cfg["rollout"]["n"]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs.append({"name": f"{cfg['runtime']['mode']} ({run_dir.name})",
                     "reward_per_samples": [(r["step"] * samples, r["reward/mean"]) for r in rows]})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="quickstart")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--async-runs", nargs="+", default=["process", "thread"], choices=sorted(ASYNC))
    parser.add_argument("--num-eval", type=int, default=100)
    parser.add_argument("--out", default="/tmp/asyncrl_bench_async_vs_sync")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="png path (default: <out>/reward_per_sample.png)")
    parser.add_argument("--curves-from", nargs="+", default=None, metavar="RUN_DIR",
                        help="only plot reward per sample of finished runs (e.g. a sync and an async quickstart)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = parser.parse_args()
    if args.curves_from:
        plot(curves_from(args.curves_from), Path(args.plot or "reward_per_sample.png"), window=50)
        return
    out_dir = Path(args.out)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "args": vars(args),
              "repeats": []}
    runs = []
    for repeat in range(args.repeats):
        results = [run(name, args, out_dir / f"r{repeat}") for name in ["sync", *args.async_runs]]
        sync = results[0]
        t_roll, t_train, bound = overlap_bound(sync)
        print(f"repeat {repeat}: sync T_rollout {t_roll:.4f}s, T_train {t_train:.4f}s -> bound {bound:.3f}x")
        rows = []
        for r in results:
            speedup = sync["step_seconds"] / r["step_seconds"]
            r.update(repeat=repeat, speedup=speedup, efficiency=speedup / bound)
            rows.append(r)
            runs.append(r)
            print(f"  {r['name']:>8}: {r['step_seconds']:.4f} s/step, {r['samples_per_second']:.0f} samples/s, speedup "
                  f"{speedup:.3f}x = {speedup / bound:.3f} of the bound; load {r['load_before']:.2f}->"
                  f"{r['load_after']:.2f}; sampled acc {r['sft_sampled_accuracy']} -> {r['final_sampled_accuracy']}"
                  + (f"; overlap {r['overlap_median']:.2f}, staleness {r['staleness_mean_median']:.2f}, "
                     f"violations {r['staleness_violations']:.0f}" if r["name"] != "sync" else ""))
        report["repeats"].append({"T_rollout_s": t_roll, "T_train_s": t_train, "overlap_bound": bound, "runs": rows})
    for name in ["sync", *args.async_runs]:
        eff = [r["efficiency"] for r in runs if r["name"] == name]
        spd = [r["speedup"] for r in runs if r["name"] == name]
        report.setdefault("summary", {})[name] = {"speedup_median": statistics.median(spd),
                                                  "efficiency_median": statistics.median(eff)}
        print(f"{name:>8}: speedup {statistics.median(spd):.3f}x, {statistics.median(eff):.3f} of the bound "
              f"(median over {len(eff)} repeats)")
    png = Path(args.plot) if args.plot else out_dir / "reward_per_sample.png"
    if plot(runs, png):
        print(f"plot: {png}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
