"""Issue 20 on one H200 in one command: the trainer's forward eager vs fused.

    python bench/trainer_speed_gpu.py --json OUT.json [--trl] [--parts update,error,long,peer]

Model: issue 8's 0.6B-shaped Qwen3 (vocab 151,936, random weights, bf16; bench/peer_trl_h200.py
builds it). "eager" = HF's modules, the padded layout with the prompt's KV shared per group and
the torch LM head: the trainer before issue 20 (``actor.kernels=eager actor.packing=padded``).
"fused" = ``actor.kernels=auto`` (Liger's RMSNorm/RoPE/SwiGLU where liger-kernel is installed,
the Triton LM head) with ``actor.packing=auto`` (the varlen layout); "fused+compile" adds
``actor.compile=true``. Parts, each guarded (a failure is reported in its row, the run goes on):

  update  Actor.update on issue 8's batch (16 prompts x 8, 256 + 256 tokens, one micro-batch of
          128 rows as in the peer run; plan fused+mb64: micro-batches of 64, the peer run's before):
          s/update (median of 5 after 2 warm-ups), MFU, peak GiB.
  error   bf16, fused vs eager from the same weights, for every loss_agg_mode: relative error of
          the summed loss, of the gradient (all parameters, ||g_f - g_e|| / ||g_e||) and the
          log-probs' mean / max absolute difference.
  long    64 completions x (512 + 2048) tokens (8 prompts x 8, micro-batches of 16): s/update,
          MFU, peak GiB eager vs fused; and the LM head alone on one micro-batch's 32,768
          states: peak memory above its inputs, full logits (HF / TRL style) vs the fused head.
  peer    bench/peer_trl_h200.py's GRPO step, each in its own process: asyncrl sync eager, sync
          fused, async fused (+ TRL with --trl; its last runs took 9-10.75 s/step): s/step,
          completions/s, actor update s, MFU.

Prints a short table last. CPU dry run of the code paths: PEER_TRL_TINY=1 (tiny shapes).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from actor_update_gpu import make_batch  # noqa: E402
from peer_trl_h200 import (MICRO_BATCH, PROMPT_TOKENS, PROMPTS, SAMPLES, VOCAB, build_checkpoint,  # noqa: E402
                           timed_summary)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = os.environ.get("PEER_TRL_TINY") == "1"
PLANS = {"eager": ["actor.kernels=eager", "actor.packing=padded"],
         "fused": ["actor.kernels=auto", "actor.packing=auto"],
         "fused+compile": ["actor.kernels=auto", "actor.packing=auto", "actor.compile=true"],
         # async on one GPU with the engine on the trainer's (default) stream: the A/B of rollout.engine_stream
         "fused+caller_stream": ["actor.kernels=auto", "actor.packing=auto", "rollout.engine_stream=caller"],
         # micro-batches of 64 rows (the peer run's setting until 2026-12-02: 0.524 s vs 0.472 s in one of 128)
         "fused+mb64": ["actor.kernels=auto", "actor.packing=auto", "actor.micro_batch_size=64"],
         # async: the weight-sync probe on every 10th push only (runtime.probe_every)
         "fused+probe10": ["actor.kernels=auto", "actor.packing=auto", "runtime.probe_every=10"],
         # the engine's q/k norm + RoPE + K/V cache write in five kernels, as before 2026-12-02 (the default
         # on a GPU is one: EngineConfig.fused_kv_write)
         "fused+torch_kv_write": ["actor.kernels=auto", "actor.packing=auto", "rollout.fused_kv_write=false"],
         # the decode CUDA graph also runs the LM head and the sampler (EngineConfig.decode_graph_sampler)
         "fused+graph_sampler": ["actor.kernels=auto", "actor.packing=auto", "rollout.decode_graph_sampler=true"]}
# plans that differ by an environment variable (read when the model is prepared or a kernel launched)
PLANS["fused+hf_attention"] = PLANS["fused"]  # HF's Qwen3 attention module (before 2026-12-03's default)
PLAN_ENV = {"fused+hf_attention": {"ASYNCRL_FUSED_ATTENTION": "0"}}
LONG = (2, 8, 32, 64) if TINY else (8, 8, 512, 2048)  # prompts, samples, prompt tokens, response tokens


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def reset_peak():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def build_actor(checkpoint: Path, plan: str, micro: int):
    from asyncrl.config import load_config
    from asyncrl.training.actor import Actor
    from asyncrl.training.model import load_policy

    cfg = load_config("quickstart", [f"model.path={checkpoint}", "model.dtype=bfloat16", "actor.lr=1e-6",
                                     f"actor.micro_batch_size={micro}", *PLANS[plan]])
    model, _ = load_policy(cfg.model.path, cfg.model.dtype, DEVICE)
    return Actor(model, cfg.actor, cfg.algorithm, cfg.rollout.temperature)


def time_updates(actor, batch, warmup: int, repeats: int) -> dict:
    for _ in range(warmup):
        actor.update(batch)
    reset_peak()
    seconds, mfu, tflops = [], [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        metrics = actor.update(batch)
        sync()
        seconds.append(time.perf_counter() - t0)
        mfu.append(metrics.get("actor/mfu", float("nan")))
        tflops.append(metrics["actor/tflops"])
    out = {"s_per_update": statistics.median(seconds), "seconds": seconds, "mfu": statistics.median(mfu),
           "tflops": statistics.median(tflops), "peak_gib": peak_gib(), "resolved": actor.plan.describe()}
    for key in ("trainer/compiled_graphs", "trainer/compile_failed"):
        if key in metrics:
            out[key] = metrics[key]
    return out


def part_update(checkpoint: Path, batch, micro: int, plans, warmup=1, repeats=3) -> list[dict]:
    rows = []
    for plan in plans:
        try:
            actor = build_actor(checkpoint, plan, micro)
            row = {"plan": plan, **time_updates(actor, batch, warmup + (2 if "compile" in plan else 0), repeats)}
        except Exception as exc:  # noqa: BLE001 -- report and go on
            row = {"plan": plan, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            traceback.print_exc()
        print(f"[update] {row}", flush=True)
        rows.append(row)
        actor = None
        reset_peak()
    return rows


def _loss_and_grads(actor, batch):
    """Summed loss (the micro-batch losses add up to it) and gradients of one update, no step."""
    from asyncrl.distributed.batches import micro_batches
    from asyncrl.algorithms import global_counts
    from asyncrl.training.mixed_precision import trained_parameters

    actor.model.train()
    actor.optimizer.zero_grad(set_to_none=True)
    tokens, seqs = global_counts(batch.response_mask)  # as Actor._optimizer_step
    loss = 0.0
    for micro, _ in micro_batches(batch, actor.dp, actor.cfg.micro_batch_size):
        loss += actor._micro_loss(micro, tokens, seqs, DEVICE)["actor/pg_loss"]
    # the fp32 masters hold the gradients where the actor keeps them (mixed_precision.py)
    return loss, [p.grad.float() for p in trained_parameters(actor.optimizer)]


def part_error(checkpoint: Path, batch, micro: int) -> list[dict]:
    from asyncrl.algorithms.aggregation import LOSS_AGG_MODES
    from asyncrl.training.actor import policy_loss_config

    eager, fused = build_actor(checkpoint, "eager", micro), build_actor(checkpoint, "fused", micro)
    rows = []
    with torch.no_grad():
        lp_e, lp_f = eager.compute_logprobs(batch), fused.compute_logprobs(batch)
    real = batch.response_mask.bool()
    lp_diff = (lp_f - lp_e)[real].abs()
    for mode in LOSS_AGG_MODES:
        try:
            for actor in (eager, fused):
                actor.algo = copy.copy(actor.algo)
                actor.algo.loss_agg_mode = mode
                actor.loss_cfg = policy_loss_config(actor.algo)
            # off-policy old log-probs (shifted by noise) so the ratio, the clip and the loss vary per token
            noisy = copy.copy(batch)
            noisy.old_logprobs = (lp_e + 0.05 * torch.randn_like(lp_e)) * batch.response_mask
            loss_e, grads_e = _loss_and_grads(eager, noisy)
            loss_f, grads_f = _loss_and_grads(fused, noisy)
            diff = sum(float((a - b).square().sum()) for a, b in zip(grads_f, grads_e)) ** 0.5
            norm = sum(float(b.square().sum()) for b in grads_e) ** 0.5
            row = {"loss_agg_mode": mode, "loss_eager": loss_e, "loss_fused": loss_f,
                   "loss_rel_err": abs(loss_f - loss_e) / max(abs(loss_e), 1e-12), "grad_rel_err": diff / norm,
                   "logprob_mean_abs_diff": float(lp_diff.mean()), "logprob_max_abs_diff": float(lp_diff.max())}
        except Exception as exc:  # noqa: BLE001
            row = {"loss_agg_mode": mode, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            traceback.print_exc()
        print(f"[error] {row}", flush=True)
        rows.append(row)
    eager = fused = None
    reset_peak()
    return rows


def part_head_memory(checkpoint: Path, tokens: int) -> dict:
    """The LM head alone on ``tokens`` states: peak memory above its inputs, forward + backward of
    log-prob + entropy, full logits (logits -> fp32 log_softmax, as HF and TRL do) vs fused."""
    from asyncrl.training.forward_plan import plan_of
    from asyncrl.training.head_logprobs import linear_logprobs
    from asyncrl.training.model import load_policy

    model, _ = load_policy(str(checkpoint), "bfloat16", DEVICE)
    weight = model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, weight.shape[1], generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, weight.shape[0], (tokens,), generator=g).to(DEVICE)

    def eager_head():
        logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
        return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)

    def fused_head():
        kernel = "triton" if DEVICE == "cuda" else "torch"
        return linear_logprobs(hidden, weight, targets, 1.0, 4096, True, kernel)

    out = {"tokens": tokens, "row_kernel": plan_of(model).head}
    for name, head in (("eager_head", eager_head), ("fused_head", fused_head)):
        try:
            reset_peak()
            base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
            sync()
            t0 = time.perf_counter()
            lp, ent = head()
            torch.autograd.grad((lp - 0.01 * ent).sum(), (hidden, weight))
            sync()
            out[f"{name}_s"] = time.perf_counter() - t0
            out[f"{name}_peak_extra_gib"] = (peak_gib() * 2**30 - base) / 2**30 if DEVICE == "cuda" else 0.0
        except Exception as exc:  # noqa: BLE001
            out[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if out.get("eager_head_peak_extra_gib"):
        out["fused_over_eager"] = out.get("fused_head_peak_extra_gib", float("nan")) / out["eager_head_peak_extra_gib"]
    print(f"[head] {out}", flush=True)
    model = None
    reset_peak()
    return out


def part_peer(checkpoint: Path, work: Path, with_trl: bool, warmup: int, timed: int, rows: list,
              runs: str = "sync:eager,sync:fused,async:fused"):
    """Fills ``rows``, yielding after each run (the caller saves then: a later failure or the
    device's time limit keeps the earlier rows). ``runs``: framework:plan pairs, in order."""
    runs = [tuple(r.split(":")) for r in runs.split(",")] + ([("trl", "-")] if with_trl else [])
    for framework, plan in runs:
        out_json = work / f"peer_{framework}_{plan}.json"
        out_json.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PEER_TRL_ASYNCRL_OVERRIDES": " ".join(PLANS.get(plan, [])), **PLAN_ENV.get(plan, {})}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(HERE / "peer_trl_h200.py"), framework, str(checkpoint),
                               str(warmup + timed), str(out_json), str(work / f"{framework}_{plan}")], env=env)
        if proc.returncode != 0 or not out_json.is_file():
            rows.append({"framework": framework, "plan": plan, "error": f"exit {proc.returncode}"})
            yield
            continue
        run = json.loads(out_json.read_text())
        summary = timed_summary(run, warmup)
        mfu = run["summary"].get("actor/mfu", [])[warmup:]
        row = {"framework": framework, "plan": plan, "s_per_step": summary["s_per_step_median"],
               "completions_per_s": summary["completions_per_s"],
               "actor_update_s": summary["stage_median_s"].get("actor_update", float("nan")),
               "mfu": statistics.median(mfu) if mfu else float("nan"), "stages": summary["stage_median_s"],
               "gpu_peak_gib": summary.get("gpu_peak_gib"), "process_s": time.perf_counter() - t0}
        for key in ("weight_sync/wait_s", "weight_sync/load_s", "weight_sync/probe_s"):  # async: the push's parts
            values = run["summary"].get(key, [])[warmup:]
            if values:
                row[key] = statistics.median(values)
        print(f"[peer] {row}", flush=True)
        rows.append(row)
        yield
    trl = next((r for r in rows if r["framework"] == "trl" and "error" not in r), None)
    for row in rows:
        if trl and "error" not in row:
            row["vs_trl"] = row["completions_per_s"] / trl["completions_per_s"]


def environment() -> dict:
    import importlib.metadata as md

    from asyncrl.training import varlen
    info = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    for name in ("transformers", "triton", "liger-kernel"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    info["varlen_probe"] = varlen.probe_flash(torch.device(DEVICE), torch.bfloat16) if DEVICE == "cuda" else "cpu"
    return info


def table(out: dict) -> str:
    lines = ["", "== issue 20: trainer speed =="]
    for row in out.get("update", []):
        lines.append(f"update  {row['plan']:14s} " + (row.get("error") or
                     f"{row['s_per_update']:.3f} s/update  MFU {row['mfu']:.1%}  {row['tflops']:.0f} TFLOP/s  "
                     f"peak {row['peak_gib']:.1f} GiB"))
    for row in out.get("error", []):
        lines.append(f"error   {row['loss_agg_mode']:24s} " + (row.get("error") or
                     f"loss rel {row['loss_rel_err']:.2e}  grad rel {row['grad_rel_err']:.2e}  "
                     f"logprob |d| mean {row['logprob_mean_abs_diff']:.2e} max {row['logprob_max_abs_diff']:.2e}"))
    for row in out.get("long", []):
        lines.append(f"long    {row['plan']:14s} " + (row.get("error") or
                     f"{row['s_per_update']:.3f} s/update  MFU {row['mfu']:.1%}  peak {row['peak_gib']:.1f} GiB"))
    head = out.get("head_memory")
    if head:
        lines.append(f"head    {head['tokens']} tokens: eager peak +{head.get('eager_head_peak_extra_gib', float('nan')):.2f}"
                     f" GiB, fused +{head.get('fused_head_peak_extra_gib', float('nan')):.2f} GiB "
                     f"(ratio {head.get('fused_over_eager', float('nan')):.3f})")
    for row in out.get("peer", []):
        lines.append(f"peer    {row['framework']:5s} {row['plan']:6s} " + (row.get("error") or
                     f"{row['s_per_step']:.3f} s/step  {row['completions_per_s']:.1f} compl/s  actor update "
                     f"{row['actor_update_s']:.3f} s  MFU {row['mfu']:.1%}"
                     + (f"  vs TRL {row['vs_trl']:.2f}x" if "vs_trl" in row else "") + _stage_tail(row)))
    return "\n".join(lines)


def _stage_tail(row: dict) -> str:
    """The step's other stages (s): rollout (async: the rollout thread's busy time), reward, weight
    sync and, for async, its wait / load / probe parts."""
    if "error" in row:
        return ""
    stages = row.get("stages", {})
    names = {"rollout": "rollout", "async_rollout_busy": "rollout_busy", "wait_rollout": "wait_rollout",
             "reward": "reward", "weight_sync": "weight_sync"}
    parts = [f"{short} {stages[k]:.3f}" for k, short in names.items() if stages.get(k)]
    parts += [f"{k.split('/')[1]} {row[k]:.3f}" for k in ("weight_sync/wait_s", "weight_sync/load_s",
                                                           "weight_sync/probe_s") if k in row]
    return "  | " + ", ".join(parts) if parts else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", default="update,error,long,peer")
    ap.add_argument("--plans", default="eager,fused,fused+compile", help="the update part's plans")
    ap.add_argument("--trl", action="store_true", help="peer part: TRL too (~2.5 min more)")
    # the first timed update after one warm-up ran 0.1 s slower in each of 3 H200 runs (2026-12-01/02):
    # two warm-ups, and the median of 5 (the fused plan's 3 runs spread 0.50-0.63 s)
    ap.add_argument("--update-warmup", type=int, default=2, help="update part: untimed updates per plan")
    ap.add_argument("--update-repeats", type=int, default=5, help="update part: timed updates (median)")
    ap.add_argument("--peer-runs", default="sync:eager,sync:fused,async:fused",
                    help="peer part: framework:plan runs in order (plans: " + ", ".join(PLANS) + ")")
    ap.add_argument("--peer-warmup", type=int, default=2)
    ap.add_argument("--peer-timed", type=int, default=4)
    ap.add_argument("--work-dir", default="/tmp/peer_trl_h200")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(work / "qwen3_06b_random_bf16")
    out = {"args": vars(args), "environment": environment()}
    print(f"[env] {out['environment']}", flush=True)

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))

    start = time.perf_counter()
    batch = make_batch(PROMPTS, SAMPLES, PROMPT_TOKENS, 256 if not TINY else 8, VOCAB, DEVICE)
    if "error" in parts:
        out["error"] = part_error(checkpoint, batch, 64)
        save()
    if "update" in parts:
        out["update"] = part_update(checkpoint, batch, MICRO_BATCH, args.plans.split(","), args.update_warmup,
                                    args.update_repeats)
        save()
    if "long" in parts:
        prompts, samples, prompt_tokens, response_tokens = LONG
        long_batch = make_batch(prompts, samples, prompt_tokens, response_tokens, VOCAB, DEVICE)
        out["long"] = part_update(checkpoint, long_batch, 16, ["eager", "fused"], warmup=1, repeats=2)
        out["head_memory"] = part_head_memory(checkpoint, 16 * response_tokens)
        save()
    if "peer" in parts:
        out["peer"] = []
        for _ in part_peer(checkpoint, work, args.trl, args.peer_warmup, args.peer_timed, out["peer"], args.peer_runs):
            save()
    out["seconds"] = time.perf_counter() - start
    save()
    print(table(out), flush=True)


if __name__ == "__main__":
    main()
