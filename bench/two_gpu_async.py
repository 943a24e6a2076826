"""Async GRPO with rollout and training on separate GPUs vs the same recipe synchronously (issue 9).

    python bench/two_gpu_async.py --json OUT.json                     # all modes, one invocation
    python bench/two_gpu_async.py --modes sync async-2gpu --timed-steps 6

The workload is issue 8's H200 setting (bench/peer_trl_h200.py: a random-weight Qwen3-0.6B with
its 151,936-token vocabulary, bf16, 256-token prompts, every completion exactly 256 new
tokens (``--new-tokens``), a cheap reward) with GRPO groups of 16: 16 prompts x 16 samples = 256 completions and
65,536 generated tokens per step. Long responses make rollout and training both GPU work (the
quickstart's 6-token answers leave the trainer host-bound: bench/gpu_colocated_async.py).

Modes (each in its own process, so no engine or allocator state carries over; the same loss
everywhere: decoupled PPO with token-level truncated weights, so only the scheduling differs):
    sync              generate, then train, on cuda:0 (colocated; the engine fills the card up to
                      --colocated-memory, 30% by default, counting the trainer's memory)
    async-1gpu        the engine in its own process on cuda:0 beside the trainer (staleness <= 1)
    async-2gpu        the engine in its own process on cuda:1; weights by NCCL broadcast
    async-2gpu-ipc    the same, weights by CUDA IPC (the child reads the trainer's GPU tensors)
Reported per mode: median step time, completions/s, generated tokens/s, each GPU's busy
fraction (``nvidia-smi`` utilization, 100 ms samples over the timed steps), the trainer's
weight-sync stall (time/weight_sync) and the push -> loaded latency (weight_sync/load_latency_s),
and each async mode's speedup over sync with the overlap bound of the sync run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODES = {  # mode -> (runtime mode, rollout device, weight transport)
    "sync": ("sync", None, None),
    "async-1gpu": ("async", "cuda:0", "shared"),
    "async-2gpu": ("async", "cuda:1", "collective"),
    "async-2gpu-ipc": ("async", "cuda:1", "shared"),
}
SAME_LOSS = ["algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]
COLOCATED_ENGINE_MEMORY, OWN_GPU_ENGINE_MEMORY = 0.3, 0.85


def mode_overrides(mode: str, args) -> list[str]:
    runtime_mode, rollout_device, transport = MODES[mode]
    out = [f"trainer.prompts_per_step={args.prompts}", f"rollout.n={args.n}", *SAME_LOSS]
    if runtime_mode == "async":
        memory = args.colocated_memory if rollout_device == "cuda:0" else OWN_GPU_ENGINE_MEMORY
        out += ["runtime.rollout_process=true", f"runtime.rollout_device={rollout_device}",
                f"runtime.weight_transport={transport}", f"rollout.gpu_memory_utilization={memory}",
                f"runtime.max_staleness={args.max_staleness}"]
    return out


def run_mode(mode: str, args) -> dict:
    """One mode in this process: ``warmup`` untimed steps, then ``timed`` steps."""
    import torch
    from asyncrl.rollout.engine_backend import EngineBackend
    from asyncrl.runtime.async_controller import build_async_controller
    from asyncrl.runtime.sync_controller import build_sync_controller
    from asyncrl.training.model import load_policy
    from peer_trl_asyncrl import asyncrl_config
    from peer_trl_h200 import MICRO_BATCH, NEW_TOKENS, _Source, build_checkpoint

    checkpoint = str(build_checkpoint(Path(args.work_dir) / "checkpoint"))
    runtime_mode = MODES[mode][0]
    gpu = torch.cuda.is_available()  # without one: a CPU dry run of the code paths (PEER_TRL_TINY=1)
    extra = ["model.dtype=bfloat16", f"trainer.device={'cuda' if gpu else 'cpu'}",
             f"rollout.max_tokens={args.new_tokens or NEW_TOKENS}", "actor.lr=1e-6",
             f"actor.micro_batch_size={args.micro_batch or MICRO_BATCH}", "logging.memory=false", *mode_overrides(mode, args)]
    extra += [] if gpu else ["runtime.rollout_device=cpu"] * (runtime_mode == "async")
    cfg = asyncrl_config(checkpoint, 0, runtime_mode, 1, str(Path(args.work_dir) / mode), extra)
    torch.manual_seed(0)
    model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, cfg.trainer.device)
    source = _Source()
    if runtime_mode == "async":  # the rollout process from the config: its device and transport
        controller = build_async_controller(cfg, model, tokenizer, source.reward, source.train_stream(),
                                            encode=source.encode)
    else:
        backend = EngineBackend(model, tokenizer, dtype=torch.bfloat16, device=cfg.trainer.device,
                                gpu_memory_utilization=args.colocated_memory)
        controller = build_sync_controller(cfg, model, backend, tokenizer, source.reward, source.train_stream(),
                                           encode=source.encode)
    controller.params.ignore_eos = True  # exactly --new-tokens per completion
    rows = []
    try:
        for step in range(1, args.warmup_steps + args.timed_steps + 1):
            start = time.time()
            metrics = controller.step(step)
            rows.append({"start": start, "end": time.time(), "stages": dict(controller.timer.step_seconds),
                         **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
    finally:
        if runtime_mode == "async":
            controller.close()
    return {"mode": mode, "rows": rows, "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0}


def summarize(run: dict, busy: dict[int, float], batch: int) -> dict:
    rows = run["timed"]
    step = statistics.median(r["end"] - r["start"] for r in rows)
    tokens = statistics.median(r["response/length_mean"] for r in rows) * batch
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    stages = sorted({k for r in rows for k in r["stages"]})
    return {"mode": run["mode"], "timed_steps": len(rows), "step_seconds": step, "completions_per_s": batch / step,
            "generated_tokens_per_s": tokens / step, "gpu_busy_fraction": busy,
            "weight_sync_stall_s": med("time/weight_sync"),
            "weight_sync_load_latency_s": med("weight_sync/load_latency_s"),
            "rollout_busy_s": med("async/rollout_seconds"), "staleness_mean": med("async/staleness_mean"),
            "staleness_violations": sum(r.get("async/staleness_violations", 0) for r in rows),
            "probe_gap_max": max((r.get("weight_sync/probe_gap", 0.0) for r in rows), default=0.0),
            "stage_median_s": {k: statistics.median(r["stages"].get(k, 0.0) for r in rows) for k in stages},
            "gpu_peak_gib": run["gpu_peak_gib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16, help="GRPO group size")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per completion (null: 256)")
    parser.add_argument("--colocated-memory", type=float, default=COLOCATED_ENGINE_MEMORY,
                        help="engine's gpu_memory_utilization when it shares cuda:0 with the trainer")
    parser.add_argument("--micro-batch", type=int, default=None, help="trainer micro-batch (null: 64)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=6)
    parser.add_argument("--work-dir", default="/tmp/asyncrl_two_gpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one mode, write json
    args = parser.parse_args()
    if args.child:
        mode, out = args.child.split("=", 1)
        Path(out).write_text(json.dumps(run_mode(mode, args)))
        return
    from gpu_colocated_async import GpuBusySampler

    batch, results = args.prompts * args.n, []
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    with GpuBusySampler(clock=time.time) as sampler:
        for mode in args.modes:
            out = Path(args.work_dir) / f"{mode}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", f"{mode}={out}"]
            if subprocess.run(cmd).returncode != 0:
                print(f"RESULT {mode} failed", flush=True)
                continue
            run = json.loads(out.read_text())
            run["timed"] = run["rows"][args.warmup_steps:]
            busy = sampler.busy_between(run["timed"][0]["start"], run["timed"][-1]["end"])
            results.append(summarize(run, busy, batch))
            print(f"RESULT {json.dumps(results[-1])}", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=2))
    report(results, args)


def report(results: list[dict], args) -> None:
    by_mode = {r["mode"]: r for r in results}
    sync = by_mode.get("sync")
    for r in results:
        line = (f"{r['mode']:>15}: {r['step_seconds']:.3f} s/step, {r['completions_per_s']:.1f} completions/s, "
                f"{r['generated_tokens_per_s']:.0f} gen tok/s, GPU busy {r['gpu_busy_fraction']}, weight sync stall "
                f"{r['weight_sync_stall_s'] * 1e3:.1f} ms, push->loaded {r['weight_sync_load_latency_s'] * 1e3:.1f} ms")
        if sync and r is not sync:
            r["speedup_vs_sync"] = sync["step_seconds"] / r["step_seconds"]
            line += f", {r['speedup_vs_sync']:.2f}x sync"
        print(line)
    if sync:
        t_roll = sync["stage_median_s"].get("rollout", 0.0) + sync["stage_median_s"].get("reward", 0.0)
        bound = sync["step_seconds"] / max(t_roll, sync["step_seconds"] - t_roll)
        print(f"sync: rollout {t_roll:.3f} s of {sync['step_seconds']:.3f} s -> overlap bound {bound:.2f}x")
        sync["overlap_bound"] = bound
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "args": vars(args), "runs": results}, indent=2))


if __name__ == "__main__":
    main()
