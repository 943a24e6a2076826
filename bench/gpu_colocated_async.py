"""Async vs sync GRPO on GPUs: rollout and training colocated on one GPU, or on two (issue 9).

    python bench/gpu_colocated_async.py --steps 30 --json out.json [dotted overrides...]
    python bench/gpu_colocated_async.py --rollout-device cuda:1 ...   # async: the engine on GPU 1

The same recipe synchronously (generate, then train, on GPU 0) and asynchronously (the rollout
engine in its own process, staleness <= 1: on GPU 0 beside the trainer, or with
``--rollout-device cuda:1`` on the second GPU, the weights shared by CUDA IPC from the
trainer's GPU and copied peer to peer after every update). Reports per mode: median step time,
samples/s, generated tokens/s, each GPU's busy fraction (``nvidia-smi`` utilization sampled
every 100 ms during the timed RL steps), the weight-sync stage time, and async/sync speedup
against the overlap bound (T_rollout + T_train) / max(T_rollout, T_train) of the sync run. Both modes use the same loss (decoupled PPO, token-level truncated weights) so
the comparison is of scheduling alone.

Model: the quickstart's task with a Qwen3-0.6B-shaped body (28 layers, hidden 1024, 16 heads,
8 KV heads, head_dim 128, intermediate 3072; the character vocabulary of the task), bf16,
warm-started by SFT on the task; GRPO groups of 16.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.runtime.pipeline import run_training

QWEN3_06B_BODY = ["model.tiny.hidden_size=1024", "model.tiny.num_hidden_layers=28", "model.tiny.num_attention_heads=16",
                  "model.tiny.num_key_value_heads=8", "model.tiny.head_dim=128", "model.tiny.intermediate_size=3072",
                  "model.dtype=bfloat16", "trainer.device=cuda"]
SAME_LOSS = ["algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]


class GpuBusySampler:
    """Samples ``nvidia-smi`` utilization of every GPU (% of the sample period a kernel ran) in a thread."""

    def __init__(self, period_s: float = 0.1, clock=time.perf_counter):
        """``clock``: the time base of ``busy_between`` (time.time to compare across processes)."""
        self.period_s, self.clock, self.samples, self._stop = period_s, clock, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GpuBusySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True).stdout
            except FileNotFoundError:  # no nvidia-smi (a CPU dry run): no samples
                return
            now = self.clock()
            for line in out.strip().splitlines():
                index, util = (f.strip() for f in line.split(","))
                if util.isdigit():
                    self.samples.append((now, int(index), int(util) / 100.0))
            time.sleep(self.period_s)

    def busy_between(self, start: float, end: float) -> dict[int, float]:
        """GPU index -> mean busy fraction over the samples in [start, end]."""
        per_gpu: dict[int, list[float]] = {}
        for t, index, util in self.samples:
            if start <= t <= end:
                per_gpu.setdefault(index, []).append(util)
        return {i: sum(u) / len(u) for i, u in sorted(per_gpu.items())}


class StepClock:
    """Wall-clock time at which each metrics row appeared (polls metrics.jsonl every 20 ms), so the
    GPU busy fraction covers the timed RL steps only, not SFT, evaluation or compilation."""

    def __init__(self, path: Path):
        self.path, self.times, self._stop = path, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            lines = self.path.read_text().count("\n") if self.path.exists() else 0
            self.times += [time.perf_counter()] * (lines - len(self.times))
            time.sleep(0.02)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.times


def run(mode: str, args, out_dir: Path, sampler: GpuBusySampler) -> dict:
    overrides = [*QWEN3_06B_BODY, *SAME_LOSS, f"trainer.steps={args.steps}", f"rollout.n={args.n}",
                 f"trainer.prompts_per_step={args.prompts}", "trainer.eval_every=0", "trainer.max_wall_seconds=null",
                 "logging.progress=false", f"logging.run_dir={out_dir / mode}", f"sft.cache_dir={out_dir / 'cache'}",
                 *args.overrides]
    if mode == "async":
        overrides += ["runtime.mode=async", f"runtime.max_staleness={args.max_staleness}", "runtime.rollout_process=true"]
        overrides += [f"runtime.rollout_device={args.rollout_device}"] if args.rollout_device else []
    cfg = load_config(args.recipe, overrides)
    clock = StepClock(out_dir / mode / "metrics.jsonl")
    summary = run_training(cfg)
    row_times = clock.stop()
    rows = [json.loads(line) for line in (out_dir / mode / "metrics.jsonl").read_text().splitlines()]
    rows = rows[args.warmup:]  # CUDA graph capture, allocator growth and the first sync stay out
    samples = cfg.trainer.prompts_per_step * cfg.rollout.n
    step_s = statistics.median(r["time/step"] for r in rows)
    tokens = statistics.median(r["response/length_mean"] for r in rows) * samples
    t0, t1 = row_times[args.warmup - 1] if args.warmup else row_times[0] - rows[0]["time/step"], row_times[-1]
    return {"mode": mode, "steps": summary["steps"], "timed_steps": len(rows), "step_seconds": step_s,
            "samples_per_second": samples / step_s, "generated_tokens_per_second": tokens / step_s,
            "rollout_seconds": statistics.median(r.get("time/rollout", 0.0) + r.get("time/reward", 0.0) for r in rows),
            "weight_sync_seconds": statistics.median(r.get("time/weight_sync", 0.0) for r in rows),
            "gpu_busy_fraction": sampler.busy_between(t0, t1),
            "stage_seconds_median": {k[5:]: statistics.median(r[k] for r in rows) for k in rows[0] if k.startswith("time/")},
            "reward_first_last": (statistics.mean(r["reward/mean"] for r in rows[:5]),
                                  statistics.mean(r["reward/mean"] for r in rows[-5:])),
            "staleness_violations": sum(r.get("async/staleness_violations", 0) for r in rows),
            "sft_sampled_accuracy": summary.get("sft_sampled_accuracy"),
            "final_sampled_accuracy": summary.get("final_sampled_accuracy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="quickstart")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--n", type=int, default=16, help="GRPO group size")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--rollout-device", default=None, help="async: the rollout process's GPU (null: the trainer's)")
    parser.add_argument("--out", default="/tmp/asyncrl_gpu_colocated")
    parser.add_argument("--json", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out_dir = Path(args.out)
    results = []
    with GpuBusySampler() as sampler:
        for mode in ("sync", "async"):
            results.append(run(mode, args, out_dir, sampler))
            print(f"RESULT {json.dumps(results[-1])}", flush=True)  # kept even if a later run is cut short
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=2))
    sync, asyn = results
    t_roll = sync["rollout_seconds"]
    t_train = sync["step_seconds"] - t_roll
    bound = (t_roll + t_train) / max(t_roll, t_train)
    speedup = sync["step_seconds"] / asyn["step_seconds"]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "runs": results,
              "sync_T_rollout_s": t_roll, "sync_T_train_s": t_train, "overlap_bound": bound, "speedup": speedup}
    for r in results:
        print(f"{r['mode']:>5}: {r['step_seconds']:.3f} s/step, {r['samples_per_second']:.0f} samples/s, "
              f"{r['generated_tokens_per_second']:.0f} gen tok/s, GPU busy {r['gpu_busy_fraction']}, "
              f"weight sync {r['weight_sync_seconds'] * 1e3:.1f} ms, reward {r['reward_first_last'][0]:.3f} -> "
              f"{r['reward_first_last'][1]:.3f}, stages {json.dumps({k: round(v, 4) for k, v in r['stage_seconds_median'].items()})}")
    print(f"sync T_rollout {t_roll:.3f}s + T_train {t_train:.3f}s -> bound {bound:.2f}x; "
          f"async/sync speedup {speedup:.2f}x ({speedup / bound:.2f} of the bound)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
