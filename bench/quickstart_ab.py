"""The CPU quickstart of two commits (or more), A/B in rounds (issue 20's "the quickstart must not get slower").

Each commit is checked out in its own git worktree and run as a user runs it (``python -m
asyncrl.cli train`` in a fresh process, ``PYTHONPATH`` = that worktree), with its own SFT cache (the
warm start is made once per commit, before the timed rounds). A round runs every commit once: all at
the same time (the default: they see the same machine load; on a 2-core machine each keeps its one
torch thread), one after the other (``--sequential``, the order rotating between rounds), or every
run of every round pinned to a core of its own (``--cores``: on a machine with quiet cores, the
least noisy). Each run reports the RL seconds and the profile's stages; a round's ratio is
commit / base. ``--also`` adds commits beside head (a bisect in one go).

    python bench/quickstart_ab.py --base 42aaef9 --pairs 4 --json out.json        # ~2 min, 2 cores
    python bench/quickstart_ab.py --base 42aaef9 --cores 2-15 --pairs 7          # one run per core, pinned
    python bench/quickstart_ab.py --base 42aaef9 --cores 2-15 --cores-per-run 2  # 2 cores each (2 torch threads)
    python bench/quickstart_ab.py --base 42aaef9 --also 4916f8a 465d2d2 --cores 1-15 --pairs 5
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
    ap.add_argument("--also", nargs="*", default=[], help="more commits run beside them, each compared with base "
                                                           "(a bisect in one go)")
    ap.add_argument("--pairs", type=int, default=4, help="rounds: one run of every commit each")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sequential", action="store_true", help="one run at a time (default: each round at once)")
    ap.add_argument("--cores", default=None, help="e.g. 2-15: every run pinned to a core of its own, as many at "
                                                  "once as there are cores")
    ap.add_argument("--cores-per-run", type=int, default=1, help="with --cores: each run gets this many (the "
                                                                   "quickstart's torch_threads is 2)")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="quickstart_ab_"))
    names = ["base", "head", *args.also]
    commits = {name: _short(ref) for name, ref in zip(names, [args.base, args.head, *args.also])}
    trees = {name: worktree(commit, root / "trees") for name, commit in commits.items()}
    (root / "runs").mkdir(parents=True, exist_ok=True)
    for name, tree in trees.items():
        checked_import(tree, root / "runs")
    cores = _cores(args.cores, args.cores_per_run)
    distinct = {tree: name for name, tree in reversed(trees.items())}  # one warm start per checkout
    _run_all([(tree, root / "runs" / f"warm_{name}", 1, name, None) for tree, name in distinct.items()], cores,
             args.set)  # the SFT warm starts, untimed
    plan = []  # (round, name): the order rotates between rounds, so no commit always starts first
    for i in range(args.pairs):
        order = names[i % len(names):] + names[:i % len(names)]
        plan += [(i, name) for name in order]
    jobs = [(trees[n], root / "runs" / f"pair{i}_{n}", args.steps, n, i) for i, n in plan]
    if args.sequential:
        runs = [r for job in jobs for r in _run_all([job], None, args.set)]
    elif cores:
        runs = _run_all(jobs, cores, args.set)
    else:  # a round at once: every commit's run sees the same load
        runs = [r for i in range(args.pairs) for r in _run_all([j for j in jobs if j[4] == i], None, args.set)]
    seconds = {(r["pair"], r["name"]): r["rl_seconds"] for r in runs}
    ratios = {name: [seconds[i, name] / seconds[i, "base"] for i in range(args.pairs)] for name in names[1:]}
    out = {"commits": commits, "steps": args.steps, "mode": "sequential" if args.sequential else
           "pinned" if cores else "concurrent", "runs": runs, "pair_ratios": ratios["head"],
           "mean_ratio": statistics.mean(ratios["head"]),
           "ratios": ratios, "median_ratios": {n: statistics.median(r) for n, r in ratios.items()},
           "stage_ratios": _stage_ratios(runs, names),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for r in runs:
        print(json.dumps(r))
    for name in names[1:]:
        stages = ", ".join(f"{k} {v:.3f}" for k, v in out["stage_ratios"][name].items())
        print(f"{name} ({commits[name]}) / base ({commits['base']}) RL seconds per round: "
              f"{[round(x, 3) for x in ratios[name]]}, mean {statistics.mean(ratios[name]):.3f}, median "
              f"{statistics.median(ratios[name]):.3f} (a noisy machine's outlier round moves the mean); "
              f"medians per stage: {stages}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.workdir is None:  # a temporary tree: unregister the worktrees made in it
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return out


def _short(ref: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], check=True, capture_output=True,
                          text=True).stdout.strip()


def _run_all(jobs: list, cores, overrides: list[str]) -> list[dict]:
    """Run ``jobs`` ((tree, run dir, steps, name, round)): all at once unpinned, or in waves of one
    run per core; each run's result, in the jobs' order."""
    out = []
    width = len(cores) if cores else len(jobs)
    for w in range(0, len(jobs), max(1, width)):
        wave = jobs[w:w + width]
        procs = [launch(tree, run, steps, overrides, cores[k] if cores else None)
                 for k, (tree, run, steps, _, _) in enumerate(wave)]
        out += [{"pair": i, "name": name, **result(proc, run, name)}
                for proc, (_, run, _, name, i) in zip(procs, wave)]
    return out


def _stage_ratios(runs: list[dict], names: list[str]) -> dict:
    """Per commit: its median of each stage (and of the RL seconds) over the base's median."""
    keys = ["rl_seconds", *sorted({k for r in runs for k in r} - {"pair", "name", "rl_seconds", "final_accuracy"})]
    med = {n: {k: statistics.median([r.get(k, 0.0) for r in runs if r["name"] == n]) for k in keys} for n in names}
    return {n: {k: med[n][k] / med["base"][k] for k in keys if med["base"][k] > 0} for n in names[1:]}


def _cores(spec, per_run: int = 1):
    """``"2-15"`` -> one taskset core list per run slot: ``["2", "3", ...]``, or with ``per_run`` 2
    ``["2,3", "4,5", ...]`` (a leftover core is not used)."""
    if not spec:
        return None
    first, _, last = spec.partition("-")
    ids = [str(c) for c in range(int(first), int(last or first) + 1)]
    return [",".join(ids[i:i + per_run]) for i in range(0, len(ids) - per_run + 1, per_run)]


if __name__ == "__main__":
    main()
