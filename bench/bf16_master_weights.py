"""bf16 training with float32 master weights vs pure bf16 vs float32 (issue 18, actor.master_dtype).

The 0.6B-shaped Qwen3 of bench/peer_trl_h200.py (random weights), one fixed GRPO-shaped batch
(8 prompts x 4 responses, 256 + 128 tokens, ±1 advantages), ``Actor.update`` in three settings:

  fp32         model.dtype=float32
  bf16+master  model.dtype=bfloat16, actor.master_dtype=float32 (the default)
  bf16 pure    model.dtype=bfloat16, actor.master_dtype=bfloat16 (the old behaviour)

Reported per setting: the fraction of trained weights (masters when there are) changed after 3
updates at lr 1e-6 — the issue's number (pure bf16: 1.9% on CPU) — the fraction of the model's
own (bf16) weights changed, the surrogate loss over 20 updates at lr 1e-5 (old log-probs held at
the start, so −A·r keeps falling: a curve to compare), seconds per update and peak memory; and
the cost of the finiteness check that now follows every optimizer step.

    python bench/bf16_master_weights.py --json out.json        # one H200: about 2 minutes
    PEER_TRL_TINY=1 python bench/bf16_master_weights.py         # CPU dry run of the code paths
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = {"fp32": ("float32", "float32"), "bf16+master": ("bfloat16", "float32"),
            "bf16 pure": ("bfloat16", "bfloat16")}


def make_batch(vocab: int, prompt_len: int, response_len: int, device):
    from asyncrl.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts, samples = 8, 4
    rows = prompts * samples
    prompt = torch.randint(1, vocab - 2, (prompts, prompt_len), generator=g).repeat_interleave(samples, 0)
    ids = torch.cat([prompt, torch.randint(1, vocab - 2, (rows, response_len), generator=g)], 1)
    adv = (torch.arange(rows) % 2 * 2 - 1).float()[:, None].expand(rows, response_len).contiguous()
    return TrainBatch(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                      response_mask=torch.ones(rows, response_len, device=device), prompt_length=prompt_len,
                      rollout_logprobs=torch.zeros(rows, response_len, device=device),
                      token_versions=torch.zeros(rows, response_len, dtype=torch.long, device=device),
                      scores=torch.zeros(rows, device=device),
                      group_ids=torch.arange(prompts).repeat_interleave(samples), advantages=adv.to(device))


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_setting(base, batch, dtype: str, master: str, lr: float, steps: int):
    """(losses, seconds per update, fraction of trained weights changed, of model weights, peak GiB)."""
    from asyncrl.config import load_config
    from asyncrl.training.actor import Actor
    from asyncrl.training.mixed_precision import trained_parameters

    cfg = load_config(None, [f"actor.lr={lr}", f"actor.master_dtype={master}", f"model.dtype={dtype}",
                             "actor.micro_batch_size=16", "algorithm.clip_ratio_low=0.99",
                             "algorithm.clip_ratio_high=100", "algorithm.clip_ratio_c=1000",
                             "algorithm.calculate_entropy=false"])
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = copy.deepcopy(base).to(device=DEVICE, dtype=getattr(torch, dtype))
    actor = Actor(model, cfg.actor, cfg.algorithm, temperature=1.0)
    batch = copy.copy(batch)
    batch.old_logprobs = actor.compute_logprobs(batch)
    trained0 = [p.detach().clone() for p in trained_parameters(actor.optimizer)]
    model0 = [p.detach().clone() for p in model.parameters()]
    losses, seconds = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        losses.append(actor.update(batch)["actor/pg_loss"])
        sync()
        seconds.append(time.perf_counter() - t0)
    def changed(before, after):
        return sum(int((a != b.detach()).sum()) for a, b in zip(before, after)) / sum(a.numel() for a in before)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    result = (losses, statistics.median(seconds[1:] or seconds), changed(trained0, trained_parameters(actor.optimizer)),
              changed(model0, list(model.parameters())), peak)
    del actor, model
    return result


def time_param_check(base, repeats: int = 20) -> float:
    """Milliseconds of ``check_parameters_finite`` (run after every optimizer step) on the bf16 model."""
    from asyncrl.training.param_check import check_parameters_finite

    model = copy.deepcopy(base).to(device=DEVICE, dtype=torch.bfloat16)
    check_parameters_finite(model, "warm-up")
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        check_parameters_finite(model, "timing")
    sync()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--curve-steps", type=int, default=20)
    ap.add_argument("--checkpoint", default="/tmp/peer_trl_h200/model")
    args = ap.parse_args()
    from peer_trl_h200 import VOCAB, build_checkpoint
    from transformers import AutoModelForCausalLM

    ckpt = build_checkpoint(Path(args.checkpoint))
    base = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    prompt_len, response_len = (256, 128) if DEVICE == "cuda" else (16, 8)
    batch = make_batch(VOCAB, prompt_len, response_len, DEVICE)
    out = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
           "settings": {}}
    for name, (dtype, master) in SETTINGS.items():
        _, _, frac, frac_model, _ = run_setting(base, batch, dtype, master, 1e-6, 3)
        curve, seconds, _, _, peak = run_setting(base, batch, dtype, master, 1e-5, args.curve_steps)
        out["settings"][name] = {"changed_after_3_steps_lr1e-6": frac, "model_weights_changed": frac_model,
                                 "loss_curve_lr1e-5": curve, "seconds_per_update": seconds, "peak_gib": peak}
        print(f"{name:12s} changed {frac:7.2%} (model {frac_model:7.2%})  loss {curve[0]:+.4f} -> {curve[-1]:+.4f}  "
              f"{seconds * 1e3:7.1f} ms/update  peak {peak:5.1f} GiB", flush=True)
    out["param_check_ms"] = time_param_check(base)
    print(f"the finiteness check after each optimizer step: {out['param_check_ms']:.2f} ms (bf16 model)")
    fp32 = out["settings"]["fp32"]["loss_curve_lr1e-5"]
    for name in ("bf16+master", "bf16 pure"):
        curve = out["settings"][name]["loss_curve_lr1e-5"]
        out["settings"][name]["max_gap_to_fp32"] = max(abs(a - b) for a, b in zip(curve, fp32))
        print(f"{name}: max |loss - fp32 loss| over the curve {out['settings'][name]['max_gap_to_fp32']:.4f} "
              f"(fp32 curve moved {fp32[0] - fp32[-1]:.4f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
