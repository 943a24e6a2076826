"""The CPU quickstart of two commits, A/B in pairs (issue 20's "the quickstart must not get slower").

Each commit is checked out in its own git worktree and run as a user runs it (``python -m
asyncrl.cli train`` in a fresh process, ``PYTHONPATH`` = that worktree), with its own SFT cache (the
warm start is made once per commit, before the timed pairs). A pair runs base and head at the same
time (``--concurrent``, the default: both see the same machine load; on a 2-core machine each keeps
its one torch thread) or one after the other, the order alternating between pairs. Each run reports
the RL seconds and the profile's stages; the pair ratio is head / base.

    python bench/quickstart_ab.py --base 42aaef9 --pairs 4 --json out.json        # ~2 min, 2 cores
    python bench/quickstart_ab.py --base 42aaef9 --cores 2-15 --pairs 7          # one run per core, pinned
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worktree(commit: str, root: Path) -> Path:
    """A detached worktree of ``commit`` under ``root`` (made once)."""
    path = root / commit
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), commit],
                       check=True, capture_output=True)
    return path


def checked_import(tree: Path, cwd: Path) -> None:
    """``asyncrl`` as a run imports it must be the worktree's: ``python -m`` puts the working
    directory first on ``sys.path``, so a run started inside a checkout would import that one."""
    found = subprocess.run([sys.executable, "-c", "import asyncrl; print(asyncrl.__file__)"], cwd=cwd,
                           env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True).stdout
    if not Path(found.strip()).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"a run for {tree} would import asyncrl from {found.strip() or '(nowhere)'}")


def launch(tree: Path, run_dir: Path, steps: int, overrides: list[str], core: str | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"trainer.steps={steps}", "seed=0",
           f"logging.run_dir={run_dir}", f"sft.cache_dir={run_dir.parent.parent / ('sft_' + tree.name)}", *overrides]
    if core is not None:
        cmd = ["taskset", "-c", core, *cmd]
    # cwd outside every checkout (see checked_import)
    return subprocess.Popen(cmd, env=env, cwd=run_dir.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def result(proc: subprocess.Popen, run_dir: Path, name: str) -> dict:
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{name}'s run failed ({run_dir}):\n{err[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"rl_seconds": summary["rl_seconds"], "final_accuracy": summary["final_accuracy"],
            **{k: v for k, v in summary["stage_seconds"].items() if v > 0}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sequential", action="store_true", help="one run at a time (default: each pair at once)")
    ap.add_argument("--cores", default=None, help="e.g. 2-15: every pair's runs pinned one core each, all at once")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides for both runs")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="quickstart_ab_"))
    commits = {name: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], check=True,
                                    capture_output=True, text=True).stdout.strip()
               for name, ref in (("base", args.base), ("head", args.head))}
    trees = {name: worktree(commit, root / "trees") for name, commit in commits.items()}
    (root / "runs").mkdir(parents=True, exist_ok=True)
    for name, tree in trees.items():  # the SFT warm starts, untimed
        checked_import(tree, root / "runs")
        run = root / "runs" / f"warm_{name}"
        result(launch(tree, run, 1, args.set, None), run, name)
    cores = _cores(args.cores)
    runs: list[dict] = []
    pending = []
    for i in range(args.pairs):
        order = ["base", "head"] if i % 2 == 0 else ["head", "base"]
        for slot, name in enumerate(order):
            run = root / "runs" / f"pair{i}_{name}"
            core = cores[(2 * i + slot) % len(cores)] if cores else None
            proc = launch(trees[name], run, args.steps, args.set, core)
            pending.append((proc, run, name, i))
            if args.sequential:
                runs.append({"pair": i, "name": name, **result(*pending.pop()[:3])})
        if not args.sequential and not cores:  # a pair at once
            runs += [{"pair": p, "name": n, **result(proc, r, n)} for proc, r, n, p in pending]
            pending = []
    runs += [{"pair": p, "name": n, **result(proc, r, n)} for proc, r, n, p in pending]  # pinned: all at once
    ratios = [next(r["rl_seconds"] for r in runs if r["pair"] == i and r["name"] == "head") /
              next(r["rl_seconds"] for r in runs if r["pair"] == i and r["name"] == "base") for i in range(args.pairs)]
    out = {"commits": commits, "steps": args.steps, "mode": "pinned" if cores else
           "sequential" if args.sequential else "concurrent", "runs": runs, "pair_ratios": ratios,
           "mean_ratio": statistics.mean(ratios), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for r in runs:
        print(json.dumps(r))
    print(f"head/base RL seconds per pair: {[round(x, 3) for x in ratios]}, mean {out['mean_ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.workdir is None:  # a temporary tree: unregister the worktrees made in it
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return out


def _cores(spec):
    if not spec:
        return None
    first, _, last = spec.partition("-")
    return [str(c) for c in range(int(first), int(last or first) + 1)]


if __name__ == "__main__":
    main()
