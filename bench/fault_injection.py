"""Fault-injection campaigns of issue 18 on CPU: real `asyncrl train` processes killed, preempted
and resumed. Results go to bench/RESULTS.md; tests/runtime/test_resume.py, test_preemption.py,
test_process_executor.py and tests/training/test_checkpoint.py run smaller versions in CI.

    python bench/fault_injection.py kill9 --runs 10        # kill -9 at a random moment, resume=auto
    python bench/fault_injection.py rollout-kills          # SIGKILL the rollout process 3 times in one run
    python bench/fault_injection.py checkpoint-kills --kills 20
    python bench/fault_injection.py sigterm --runs 6 --steps 24
    python bench/fault_injection.py all --json out.json

Every run is the quickstart on the tiny model (hidden 32, 2 layers), 4 prompts x 4 samples per
step, fixed seed. "Learning metrics" are every metric except wall-clock, memory, async queue
depths and the weight-sync probe's diagnostics (docs/reliability.md says why those differ).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.metrics.measured import learning_metrics  # noqa: E402
from asyncrl.training.checkpoint import is_complete, latest_checkpoint  # noqa: E402

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.prompts_per_step=4",
        "rollout.n=4", "task.num_eval=16", "logging.progress=false", "logging.tensorboard=false",
        "logging.report=false", "trainer.eval_samples=0"]
ASYNC = ["runtime.mode=async", "runtime.rollout_process=true", "runtime.max_staleness=1",
         "algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]


def train(run: Path, cache: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = [sys.executable, "-m", "asyncrl.cli", "train", "quickstart", *TINY, f"logging.run_dir={run}",
            f"sft.cache_dir={cache}", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def rows(run: Path) -> list[dict]:
    """The complete rows of metrics.jsonl (a line cut by a kill is skipped)."""
    path, out = run / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out



def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_first_row(proc: subprocess.Popen, run: Path) -> float:
    """When the run's first step row appeared (monotonic seconds)."""
    while not rows(run) and proc.poll() is None:
        time.sleep(0.02)
    return time.monotonic()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the trainer and its rollout process), as an OOM killer
    or a node failure would; a run that already ended is left alone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_ok(proc: subprocess.Popen, what: str, timeout: float = 900) -> None:
    rc = proc.wait(timeout)
    if rc != 0:
        raise SystemExit(f"{what} exited {rc}: {proc.stderr.read()[-2000:]}")


# ---- campaigns --------------------------------------------------------------------------------

def kill9(work: Path, runs: int, steps: int, rng: random.Random, modes=("sync", "async")) -> dict:
    """Half sync, half async: a reference run, then each run killed with SIGKILL (its process
    group: trainer and rollout process) at a uniform moment of its training phase (from its
    first step row to its last in the reference; start-up and the final eval are most of a tiny
    run's life), then `trainer.resume=auto` to the end. Sync: every learning metric bit-equal
    to the reference."""
    cache, results = work / "cache", []
    for mode, extra in (("sync", []), ("async", ASYNC)):
        if mode not in modes:
            continue
        common = [f"trainer.steps={steps}", "trainer.checkpoint_every=2", *extra]
        ref = train(work / f"ref-{mode}", cache, *common)
        first_row = wait_first_row(ref, work / f"ref-{mode}")
        while len(rows(work / f"ref-{mode}")) < steps and ref.poll() is None:
            time.sleep(0.02)
        duration = time.monotonic() - first_row
        wait_ok(ref, f"{mode} reference")
        reference = rows(work / f"ref-{mode}")
        for i in range(runs // len(modes)):
            run = work / f"kill9-{mode}-{i}"
            proc = train(run, cache, *common)
            wait_first_row(proc, run)
            moment = rng.uniform(0.0, 1.0) * duration
            time.sleep(moment)
            finished_first = proc.poll() is not None
            kill_group(proc)
            killed_at = len(rows(run))
            ckpt = latest_checkpoint(run)
            wait_ok(train(run, cache, *common, "trainer.resume=auto"), f"resume of {run}")
            got = rows(run)
            equal = sum(learning_metrics(a) == learning_metrics(b) for a, b in zip(got, reference))
            results.append({"mode": mode, "kill_s": round(moment, 2), "rows_at_kill": killed_at,
                            "resumed_from": ckpt.name if ckpt else None, "finished_before_kill": finished_first,
                            "steps": [r["step"] for r in got] == list(range(1, steps + 1)),
                            "steps_equal": equal, "violations": sum(r.get("async/staleness_violations", 0) for r in got),
                            "samples_full": all(r["batch/samples"] == 16 for r in got)})
            print(json.dumps(results[-1]), flush=True)
    sync = [r for r in results if r["mode"] == "sync"]
    return {"runs": results, "all_steps_once": all(r["steps"] for r in results),
            "sync_bit_equal": all(r["steps_equal"] == steps for r in sync)}


def rollout_kills(work: Path, steps: int, rng: random.Random) -> dict:
    """One async run; its rollout process SIGKILLed after 3 random step rows."""
    run = work / "rollout-kills"
    proc = train(run, work / "cache", f"trainer.steps={steps}", "runtime.max_restarts=3", *ASYNC)
    targets, killed = sorted(rng.sample(range(1, steps - 1), 3)), []
    while proc.poll() is None and len(killed) < 3:
        if len(rows(run)) >= targets[len(killed)]:
            rollout = [c for c in children_of(proc.pid) if "multiprocessing.spawn" in _cmdline(c) and alive(c)]
            if rollout:
                os.kill(rollout[0], signal.SIGKILL)
                killed.append((len(rows(run)), rollout[0]))
                time.sleep(rng.uniform(0.0, 0.5))
        time.sleep(0.02)
    wait_ok(proc, "rollout-kills run")
    got = rows(run)
    return {"killed_after_rows": [k[0] for k in killed], "pids": [k[1] for k in killed],
            "steps": len(got), "restarts": got[-1]["async/rollout_restarts"],
            "violations": sum(r["async/staleness_violations"] for r in got),
            "samples_per_step": sorted({r["batch/samples"] for r in got})}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def checkpoint_kills(work: Path, kills: int, rng: random.Random) -> dict:
    """Each run saves at steps 2 and 4 and the final step 5; it is SIGKILLed once a chosen save
    (the second or the final one) has begun (its .tmp-step dir appeared), after a random delay of
    0-80 ms. Then `asyncrl eval RUN` must load `latest`."""
    results = []
    for i in range(kills):
        run, target = work / f"ckpt-kill-{i}", rng.choice(["step_000004", "step_000005"])
        proc = train(run, work / "cache", "trainer.steps=5", "trainer.checkpoint_every=2")
        root = run / "checkpoints"
        while proc.poll() is None and not (root.is_dir() and list(root.glob(f".tmp-{target}-*"))):
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.08))
        mid_write = root.is_dir() and bool(list(root.glob(".tmp-step_*")))
        kill_group(proc)
        latest = latest_checkpoint(run)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        ev = subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", "quickstart", f"model.path={run}",
                             f"logging.run_dir={work / f'eval-{i}'}", "task.num_eval=16", *TINY[:4]],
                            env=env, capture_output=True, text=True)
        results.append({"target": target, "mid_write": mid_write, "latest": latest.name if latest else None,
                        "complete": bool(latest and is_complete(latest)), "eval_rc": ev.returncode})
        print(json.dumps(results[-1]), flush=True)
    return {"kills": results, "all_loaded": all(r["complete"] and r["eval_rc"] == 0 for r in results),
            "mid_write": sum(r["mid_write"] for r in results)}


def sigterm(work: Path, runs: int, steps: int, rng: random.Random) -> dict:
    """SIGTERM at a random moment after the first step row (half sync, half async with the
    rollout process): exit 0, summary, a complete checkpoint of the last step, no child left."""
    results = []
    for i in range(runs):
        mode, extra = (("sync", []) if i % 2 == 0 else ("async", ASYNC))
        run = work / f"sigterm-{i}"
        proc = train(run, work / "cache", f"trainer.steps={steps}", *extra)
        wait_first_row(proc, run)
        time.sleep(rng.uniform(0.0, 1.0))  # within the training phase of a --steps 24 run
        children = children_of(proc.pid)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(600)
        seconds = time.monotonic() - start
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        latest = latest_checkpoint(run)
        time.sleep(1.0)
        results.append({"mode": mode, "rc": rc, "exit_s": round(seconds, 2), "preempted": summary.get("preempted"),
                        "steps": summary.get("steps"), "latest": latest.name if latest else None,
                        "latest_is_last_step": bool(latest) and int(latest.name[5:]) == summary.get("steps"),
                        "children_left": [c for c in children if alive(c)],
                        "traceback": "Traceback" in proc.stderr.read()})
        print(json.dumps(results[-1]), flush=True)
    return {"runs": results, "all_ok": all(r["rc"] == 0 and r["latest_is_last_step"] and not r["children_left"]
                                           and not r["traceback"] for r in results)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("campaign", choices=("kill9", "rollout-kills", "checkpoint-kills", "sigterm", "all"))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="sync,async", help="kill9: sync, async or both")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.work or tempfile.mkdtemp(prefix="asyncrl-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    try:
        if args.campaign in ("kill9", "all"):
            out["kill9"] = kill9(work, args.runs, args.steps, rng, tuple(args.modes.split(",")))
        if args.campaign in ("rollout-kills", "all"):
            out["rollout_kills"] = rollout_kills(work, args.steps, rng)
        if args.campaign in ("checkpoint-kills", "all"):
            out["checkpoint_kills"] = checkpoint_kills(work, args.kills, rng)
        if args.campaign in ("sigterm", "all"):
            out["sigterm"] = sigterm(work, 6 if args.campaign == "all" else args.runs, max(args.steps, 24), rng)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
