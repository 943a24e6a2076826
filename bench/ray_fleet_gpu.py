"""GPU smoke run of the Ray fleet (``runtime.executor=ray``, docs/fleet.md): the quickstart's
trainer on the CPU (the driver), ``--engines`` replica actors of the asyncrl engine, one GPU
each (a local Ray sees every GPU; each actor is shown only its bundle's), weights through the
object store. Checks what the CPU test checks, on GPUs: 0 staleness violations, every replica
on the pushed version after every sync (``fleet/version_spread`` 0), the probe gap on each,
both replicas busy; prints one JSON line.

    python bench/ray_fleet_gpu.py --engines 2 --steps 20     # 2 GPUs, about 2-3 min (needs ray)
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="the replicas' device kind (cpu: a dry run of this script)")
    args = parser.parse_args()
    from asyncrl.config import load_config
    from asyncrl.runtime.pipeline import run_training

    run = Path(tempfile.mkdtemp(prefix="ray-fleet-gpu-"))
    cfg = load_config("quickstart", [
        f"logging.run_dir={run}", "logging.progress=false", "logging.tensorboard=false",
        f"trainer.steps={args.steps}", "trainer.device=cpu", "runtime.mode=async", "runtime.executor=ray",
        "algorithm.decoupled=true", "algorithm.rollout_correction.level=token", f"rollout.engines={args.engines}",
        f"runtime.rollout_device={args.device}", f"runtime.rollout_workers={args.engines}", "rollout.gpu_memory_utilization=0.2"])
    start = time.perf_counter()
    summary = run_training(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "fleet/version_spread" in r]
    busy = {i: sum(r.get(f"fleet/replica{i}/busy", 0.0) for r in rows) / max(len(rows), 1) for i in range(args.engines)}
    print(json.dumps({
        "steps": summary["steps"], "wall_s": round(time.perf_counter() - start, 1),
        "staleness_violations": max(r["async/staleness_violations"] for r in rows),
        "version_spread_max": max(r["fleet/version_spread"] for r in rows),
        "probe_gap_max": max(r.get("weight_sync/probe_gap", 0.0) for r in rows),
        "replicas_alive": rows[-1]["fleet/replicas_alive"], "busy_mean": {k: round(v, 3) for k, v in busy.items()},
        "tokens_per_s_last": {i: round(rows[-1].get(f"fleet/replica{i}/tokens_per_s", 0.0), 1)
                              for i in range(args.engines)},
        "replica_logs": str(run / "rollout")}), flush=True)


if __name__ == "__main__":
    main()
