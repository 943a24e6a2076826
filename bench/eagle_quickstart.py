"""EAGLE on the CPU quickstart policy (issue 23): acceptance of a head from ``asyncrl train-draft``
vs an untrained head and n-gram drafting, and what acceptance does as RL moves the policy.

1. ``asyncrl train-draft quickstart`` on the SFT warm start (policy version 0): head v0.
   Its ``train_draft.json`` holds, on ``--eval-prompts`` held-out prompts (greedy, and sampled at the rollout's
   temperature 1.0), the acceptance rate and tokens per target pass of head v0, the untrained head
   it started from and n-gram drafting: same run, same prompts.
2. For each checkpoint of an RL run of the quickstart (``--rl-run``: ``asyncrl train quickstart
   trainer.checkpoint_every=200 ...``): ``train-draft model.path=CKPT draft.init=v0
   draft.steps=--refresh-steps``: the "initial" row is head v0 against the moved policy (the
   drift), the "eagle" row the refreshed head.

    python bench/eagle_quickstart.py --rl-run /tmp/rl600 --json bench/results/eagle_quickstart_cpu.json
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.runtime.draft_job import run_train_draft  # noqa: E402
from asyncrl.training.checkpoint import complete_checkpoints  # noqa: E402


def train_draft(overrides: list[str]) -> dict:
    t0 = time.perf_counter()
    record = run_train_draft(load_config("quickstart", overrides))
    return {"seconds": round(time.perf_counter() - t0, 1), "train": record["train"], "acceptance": record["acceptance"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rl-run", default=None, help="a quickstart RL run dir with checkpoints (drift rows)")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--refresh-steps", type=int, default=100)
    ap.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per acceptance row")
    ap.add_argument("--out", default=None, help="where the heads go (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="eagle_quickstart_"))
    common = [f"draft.prompts={args.prompts}", f"draft.eval_prompts={args.eval_prompts}", "trainer.device=cpu",
              "trainer.torch_threads=1"]
    results = dict(provenance(" ".join(sys.argv)), device="cpu", rows={})  # trainer.device=cpu
    results["rows"]["v0"] = train_draft(common + [f"draft.output={out / 'v0'}", f"draft.steps={args.steps}"])
    print("v0", json.dumps(results["rows"]["v0"]), flush=True)
    for ckpt in complete_checkpoints(Path(args.rl_run)) if args.rl_run else []:
        name = ckpt.name
        results["rows"][name] = train_draft(common + [f"model.path={ckpt}", f"draft.init={out / 'v0'}",
                                                      f"draft.output={out / name}", f"draft.steps={args.refresh_steps}"])
        print(name, json.dumps(results["rows"][name]), flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
