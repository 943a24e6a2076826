"""Does the quickstart learn the same on 2 FSDP2 ranks as in one process? (issue 15, CPU)

For each seed, the quickstart (`asyncrl train`) runs a fixed number of RL steps twice, each with
its own empty warm-start cache (SFT is deterministic: the SFT accuracies must match): once in
one process, once on two gloo ranks (`trainer.gpus=2 trainer.device=cpu`). The steps are fixed
(no wall-clock stop), so both runs make the same updates; the sharded trainer's step equals one process's to ~1e-6
(tests/distributed/test_fsdp.py), and the held-out gains should agree within seed noise.
Rank 0 drives the rollout with the same seed, so the two runs also sample the same rollouts
until float rounding first flips a sampled token: the table says for how many steps the
per-step mean reward stayed identical. Prints a markdown table for bench/RESULTS.md and
writes the summaries and reward curves as JSON.

    python bench/fsdp_quickstart_learning.py --seeds 0 --steps 100 --parallel   # ~10 min on 2 free cores
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from quickstart_runs import TrainProcess, gain_points, start_train, write_json

SETUPS = {"1 process": [], "2 ranks (fsdp2, gloo)": ["trainer.gpus=2", "trainer.device=cpu"]}


def start(seed: int, steps: int, extra: list[str], out_dir: Path, name: str, warm: Path | None = None) -> TrainProcess:
    """One `asyncrl train` in a fresh process; ``warm``: a warm-start cache of an earlier run of
    this seed, copied in (skips the SFT)."""
    run_dir = out_dir / f"seed{seed}-{name.split()[0]}"
    if warm is not None:
        shutil.copytree(warm, run_dir.with_suffix(".cache"))
    return start_train(seed, run_dir, run_dir.with_suffix(".cache"),
                       [f"trainer.steps={steps}", "trainer.max_wall_seconds=100000", *extra], env={"OMP_NUM_THREADS": "1"})


def finish(run: TrainProcess) -> dict:
    """Wait for the run; its summary.json, the process's wall time and the per-step mean reward."""
    summary = run.finish()
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    summary["reward_curve"] = [r["reward/mean"] for r in rows if "reward/mean" in r]
    return summary


def identical_steps(a: list[float], b: list[float]) -> int:
    """How many leading steps have exactly the same mean reward."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--parallel", action="store_true", help="a seed's two runs at the same time")
    parser.add_argument("--warm-cache", type=Path, help="an earlier run's warm-start cache (ASYNCRL_CACHE) "
                        "for the one seed given: copied for every run, no SFT")
    parser.add_argument("--json", type=Path, default=Path("bench/results/fsdp_quickstart_learning.json"))
    args = parser.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="asyncrl-fsdp-learn-"))
    rows = []
    for seed in args.seeds:
        if args.parallel:
            started = {name: start(seed, args.steps, extra, out_dir, name, args.warm_cache)
                       for name, extra in SETUPS.items()}
            done = {name: finish(run) for name, run in started.items()}
        else:
            done = {name: finish(start(seed, args.steps, extra, out_dir, name, args.warm_cache))
                    for name, extra in SETUPS.items()}
        rows += [{"seed": seed, "setup": name, **summary} for name, summary in done.items()]
    print("| seed | trainer | sampled acc SFT -> RL | gain | greedy acc SFT -> RL | gain | RL steps | mean reward, "
          "last 20 steps | steps with identical reward | RL s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["seed"] == r["seed"])  # the seed's one-process run
        tail = r["reward_curve"][-20:]
        print(f"| {r['seed']} | {r['setup']} | {r['sft_sampled_accuracy']:.3f} -> {r['final_sampled_accuracy']:.3f} | "
              f"{gain_points(r, 'sampled_accuracy'):+.1f} | {r['sft_accuracy']:.3f} -> {r['final_accuracy']:.3f} | "
              f"{gain_points(r, 'accuracy'):+.1f} | {r['steps']} | {sum(tail) / len(tail):.3f} | "
              f"{identical_steps(r['reward_curve'], base['reward_curve'])} | {r['rl_seconds']:.0f} |")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
