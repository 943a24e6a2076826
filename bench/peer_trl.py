"""Side by side with TRL (issue 8): the same GRPO run in TRL's GRPOTrainer and in asyncrl.

CPU setting (default)::

    python bench/peer_trl.py --seeds 0 --budget 120 --eval-every 100 \\
        --json bench/results/peer_trl_cpu.json --plot bench/results/peer_trl_cpu.png

Per seed: one SFT warm start saved as an HF checkpoint (bench/peer_trl_setting.py), then TRL,
asyncrl sync and asyncrl async, each from that checkpoint with the same seed and the same
prompts in the same order, until ``--steps`` optimizer steps or ``--budget`` seconds of
training (evaluation time excluded), with held-out accuracy every ``--eval-every`` steps.
The run order rotates with the seed, so no framework always runs first on a shared machine.

H200 setting (``--setting h200``): throughput only, see bench/peer_trl_h200.py.

TRL is a benchmark-only dependency: ``pip install -e '.[bench]'``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

FRAMEWORKS = ("trl", "sync", "async")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=("cpu", "h200"), default="cpu")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--steps", type=int, default=None, help="stop each run after this many steps")
    p.add_argument("--budget", type=float, default=None, help="stop each run after this many training seconds")
    p.add_argument("--eval-every", type=int, default=100, help="held-out eval every N steps (0: start and end)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the issue: 2)")
    p.add_argument("--interleave", action="store_true",
                   help="run TRL and asyncrl sync step by step in turns (same machine load for both); "
                        "async runs after them, alone")
    p.add_argument("--work-dir", default=None, help="SFT checkpoints and run dirs (default: a temp dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--warmup-steps", type=int, default=3, help="h200: untimed steps")
    p.add_argument("--timed-steps", type=int, default=5, help="h200: timed steps")
    p.add_argument("--report", default=None, metavar="JSON", help="print the table (and --plot) of a saved run")
    args = p.parse_args(argv)
    if args.setting == "cpu" and args.steps is None and args.budget is None and not args.report:
        p.error("give --steps and/or --budget")
    return args


def machine() -> dict:
    import torch
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "torch": torch.__version__, "load_avg_1_5_15": [round(x, 2) for x in load],
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                     text=True).stdout.strip()}


def run_cpu(args) -> dict:
    from peer_trl_asyncrl import run_asyncrl
    from peer_trl_clock import Limits
    from peer_trl_setting import Evaluator, build_task, warm_start
    from peer_trl_trl import run_trl
    from transformers import AutoTokenizer

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="peer_trl_"))
    limits = Limits(args.steps, args.budget, args.eval_every)
    out = {"setting": "cpu", "args": vars(args), "machine_before": machine(), "runs": [], "warm_starts": {}}
    for seed in args.seeds:
        checkpoint, info = warm_start(seed, work, args.threads)
        out["warm_starts"][seed] = info
        task = build_task(seed)
        evaluate = Evaluator(task, AutoTokenizer.from_pretrained(str(checkpoint)), seed)
        order = args.frameworks[seed % len(args.frameworks):] + args.frameworks[:seed % len(args.frameworks)]
        if args.interleave and {"trl", "sync"} <= set(order):
            records = run_pair(checkpoint, task, seed, limits, evaluate, work, args.threads)
            for record in records:
                out["runs"].append(record.to_json())
                print_summary(record.summary())
            save(out, args.json)
            order = [name for name in order if name not in ("trl", "sync")]
        for name in order:
            print(f"[peer_trl] seed {seed}: {name} (load {os.getloadavg()[0]:.2f})", flush=True)
            if name == "trl":
                record = run_trl(str(checkpoint), task, seed, limits, evaluate, str(work / f"trl_{seed}"), args.threads)
            else:
                record = run_asyncrl(str(checkpoint), seed, name, limits, evaluate,
                                     str(work / f"asyncrl_{name}_{seed}"), args.threads)
            record.extra["load_avg_1"] = round(os.getloadavg()[0], 2)
            out["runs"].append(record.to_json())
            print_summary(record.summary())
            save(out, args.json)
    out["machine_after"] = machine()
    return out


def save(result: dict, path) -> None:
    """Write the json now (a long run keeps what it measured if stopped later)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str))


def run_pair(checkpoint, task, seed, limits, evaluate, work: Path, threads: int):
    """TRL (in a thread) and asyncrl sync (here) alternating one step each."""
    import threading
    from peer_trl_asyncrl import run_asyncrl
    from peer_trl_clock import Baton
    from peer_trl_trl import run_trl

    baton, result, errors = Baton(), [], []

    def trl_side():
        try:
            result.append(run_trl(str(checkpoint), task, seed, limits, evaluate, str(work / f"trl_{seed}"), threads,
                                  baton=baton))
        except BaseException as err:  # surfaced in the main thread
            errors.append(err)
            baton.finish()
    print(f"[peer_trl] seed {seed}: trl + sync interleaved (load {os.getloadavg()[0]:.2f})", flush=True)
    worker = threading.Thread(target=trl_side, daemon=True)
    worker.start()
    baton.turn()  # TRL's loading, first eval and step 1 alone: from_pretrained is not thread-safe
    ours = run_asyncrl(str(checkpoint), seed, "sync", limits, evaluate, str(work / f"asyncrl_sync_{seed}"), threads,
                       between=baton.turn)
    baton.drain()
    worker.join()
    if errors:
        raise errors[0]
    for record in (result[0], ours):
        record.extra.update(interleaved=True, load_avg_1=round(os.getloadavg()[0], 2))
    return result[0], ours


def print_summary(s: dict) -> None:
    last, first = s["last_eval"] or {}, s["first_eval"] or {}
    stages = ", ".join(f"{k} {v * 1000:.0f}" for k, v in s["stage_median_s"].items() if v > 0.0005)
    print(f"  {s['framework']:14s} seed {s['seed']}: {s['steps']} steps in {s['train_seconds']:.1f}s, "
          f"{s['s_per_step_median'] * 1000:.0f} ms/step (median), {s['completions_per_s']:.0f} completions/s, "
          f"{s['gen_tokens_per_s']:.0f} tok/s; greedy {first.get('greedy', float('nan')):.3f} -> "
          f"{last.get('greedy', float('nan')):.3f}, sampled {first.get('sampled', float('nan')):.3f} -> "
          f"{last.get('sampled', float('nan')):.3f}; stage medians (ms): {stages}", flush=True)


def _eval_at(run: dict, step: int) -> dict:
    """The evaluation at ``step`` (evaluations happen every --eval-every steps)."""
    return next(e for e in run["evals"] if e["step"] == step)


def table(result: dict) -> str:
    """Markdown: per framework, means over seeds of speed, and held-out accuracy (greedy /
    sampled) at the start, at the last step every run reached (equal steps) and at the end of
    the budget (equal training seconds). Per-seed values are in the json."""
    by: dict[str, list[dict]] = {}
    for run in result["runs"]:
        by.setdefault(run["summary"]["framework"], []).append(run)
    # the last step every run evaluated (with --eval-every 0 runs evaluate only at start and end)
    common = max(set.intersection(*({e["step"] for e in run["evals"]} for run in result["runs"])))
    trl_cps = statistics.mean(r["summary"]["completions_per_s"] for r in by.get("trl", [])) if "trl" in by else None
    rows = [f"| framework | seeds | steps | s/step (median) | completions/s | vs TRL | gen tok/s | "
            f"acc. start (greedy / sampled) | at step {common} | at the end |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in by.items():
        mean = lambda key: statistics.mean(r["summary"][key] for r in runs)
        acc = lambda pick: " / ".join(f"{statistics.mean(pick(r)[k] for r in runs):.3f}" for k in ("greedy", "sampled"))
        ratio = f"{mean('completions_per_s') / trl_cps:.2f}x" if trl_cps else "-"
        rows.append(f"| {name} | {len(runs)} | {mean('steps'):.0f} | {mean('s_per_step_median'):.3f} | "
                    f"{mean('completions_per_s'):.0f} | {ratio} | {mean('gen_tokens_per_s'):.0f} | "
                    f"{acc(lambda r: r['evals'][0])} | {acc(lambda r: _eval_at(r, common))} | "
                    f"{acc(lambda r: r['evals'][-1])} |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        print(table(result))
        if args.plot:
            from peer_trl_plot import plot
            plot(result, args.plot)
        return result
    if args.interleave:
        # Two frameworks' threads take turns: OpenMP workers of the idle one must sleep, not spin
        # (libgomp's default spin-wait stole up to 10x of a step from the other side). Read by
        # libgomp when torch loads, so it is set before the first torch import.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.setting == "h200":
        from peer_trl_h200 import run_h200
        result = run_h200(args)
    else:
        result = run_cpu(args)
        print(table(result))
        if args.plot:
            from peer_trl_plot import plot
            plot(result, args.plot)
    save(result, args.json)
    return result


if __name__ == "__main__":
    main()
