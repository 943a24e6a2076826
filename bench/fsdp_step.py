"""One GRPO trainer step of a Qwen3-8B-shaped and a Qwen3-1.7B-shaped model on one GPU with the
FSDP2 trainer (issue 15): seconds per step, stage shares, peak GPU and host memory.

Setting: random weights (fp32 master shards, bf16 compute), the real vocabulary (151,936),
64 completions = 8 prompts x 8 samples, prompt 256 + response 256 tokens, token-mean GRPO
loss (ppo_clip), one optimizer step per batch. Stages, as the trainer's profile names them:
    old_logprobs   a forward over the batch (what PPO epochs / mini-batches or a KL in the reward need)
    actor_update   forward + backward + gradient clip + AdamW step
    weight_sync    the bucketed full-tensor stream (rollout.weight_sync_bucket_mb) copied into a
                   bf16 receive buffer on the GPU, as the engine's load does
Rollout is not run here (its speed is issue 4's rows in RESULTS.md).

Configurations (each in its own process, so peaks do not mix):
    8b       36 layers, hidden 4096, untied: actor.offload=optimizer (Adam moments in pinned host
             memory, streamed per step), actor.gradient_checkpointing=true
    1.7b     28 layers, hidden 2048, tied: no offload, activation checkpointing
    8b-none  the 8B shape without offload: expected not to fit (reported as OOM), run last

    python bench/fsdp_step.py --json bench/results/fsdp_step.json       # all, ~4-5 min on one H200
    python bench/fsdp_step.py --configs 1.7b,8b --steps 1 --json bench/results/fsdp_step_h200.json  # ~90 s
    python bench/fsdp_step.py --configs 1.7b --steps 2                  # one configuration
    python bench/fsdp_step.py --configs tiny --device cpu               # a CPU dry run of the script
    python bench/fsdp_step.py --configs 1.7b --set actor.kernels=eager # extra config overrides, every config
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # Qwen3Config fields of the public checkpoints' shapes
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
CONFIGS = {  # name: (shape, overrides)
    "8b": ("8b", ["actor.offload=optimizer", "actor.gradient_checkpointing=true", "actor.micro_batch_size=16"]),
    "1.7b": ("1.7b", ["actor.gradient_checkpointing=true", "actor.micro_batch_size=32"]),
    "8b-none": ("8b", ["actor.gradient_checkpointing=true", "actor.micro_batch_size=16"]),
    "tiny": ("tiny", ["actor.offload=optimizer", "actor.gradient_checkpointing=true", "actor.micro_batch_size=16"]),
}
VOCAB = 151_936
STAGES = ("old_logprobs", "actor_update", "weight_sync")


def make_batch(prompts: int, samples: int, prompt_len: int, response_len: int, vocab: int):
    """Random GRPO batch on the CPU (the trainer moves each micro-batch to its device)."""
    from asyncrl.types import TrainBatch

    gen = torch.Generator().manual_seed(0)
    rows = prompts * samples
    prompt = torch.randint(1, vocab - 2, (prompts, prompt_len), generator=gen).repeat_interleave(samples, 0)
    ids = torch.cat([prompt, torch.randint(1, vocab - 2, (rows, response_len), generator=gen)], 1)
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(rows, response_len),
                      prompt_length=prompt_len, rollout_logprobs=-torch.rand(rows, response_len, generator=gen) * 5,
                      token_versions=torch.zeros(rows, response_len, dtype=torch.long),
                      scores=torch.rand(rows, generator=gen), group_ids=torch.arange(prompts).repeat_interleave(samples),
                      advantages=torch.randn(rows, 1, generator=gen).expand(rows, response_len).contiguous())


class GpuReceiver:
    """Stands in for the engine's weight load: copies every streamed tensor into a reused
    bf16 buffer on the GPU (the engine copies into its own parameters the same way)."""

    def __init__(self, device):
        self.device, self.buffer, self.bytes = device, None, 0

    def update_weights(self, named_tensors, version: int) -> None:
        for _, tensor in named_tensors:
            flat = tensor.reshape(-1)
            if self.buffer is None or self.buffer.numel() < flat.numel():
                self.buffer = torch.empty(flat.numel(), dtype=torch.bfloat16, device=self.device)
            self.buffer[:flat.numel()].copy_(flat)
            self.bytes += flat.numel() * 2
        self.version = version


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(name: str, steps: int, device_name: str, extra: list[str]) -> dict:
    """Build, warm up one step, time ``steps`` steps; returns the row."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncrl.config import load_config
    from asyncrl.distributed.group import init_distributed
    from asyncrl.metrics.memory import MIB, rss_bytes, rss_peak_bytes
    from asyncrl.runtime.publisher import WeightPublisher
    from asyncrl.runtime.roles import build_roles

    shape, overrides = CONFIGS[name]
    overrides = [*overrides, *extra]
    cfg = load_config(None, [*overrides, "trainer.strategy=fsdp2", f"trainer.device={device_name}",
                             "model.dtype=bfloat16", "algorithm.loss_agg_mode=token-mean", "actor.mini_batches=1",
                             "actor.ppo_epochs=1", "actor.logprob_chunk_tokens=4096", "rollout.weight_sync_bucket_mb=512"])
    dp = init_distributed(cfg.trainer)
    device = dp.device
    config = Qwen3Config(vocab_size=VOCAB if shape != "tiny" else 512, max_position_embeddings=4096,
                         **SHAPES[shape])
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)  # fp32 master weights, random (HF init), built where they train
    actor, _, _ = build_roles(cfg, model, dp)
    params = sum(p.numel() for p in actor.forward_module.parameters())
    receiver = GpuReceiver(device)
    publisher = WeightPublisher(actor, receiver, cfg.rollout.weight_sync_bucket_mb, torch.bfloat16)
    batch = make_batch(8, 8, 256, 256, config.vocab_size)
    build_seconds = time.perf_counter() - started
    row = {"config": name, "parameters": params, "overrides": overrides, "build_seconds": build_seconds}
    try:
        timings = [_step(actor, publisher, batch, device) for _ in range(steps + 1)]
    except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
        if "out of memory" not in str(err).lower():
            raise
        row.update(oom=True, error=str(err).splitlines()[0],
                   peak_gpu_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30)
        return row
    timed = timings[1:]  # the first step allocates the optimizer state and warms the kernels
    mean = {stage: sum(t[stage] for t in timed) / len(timed) for stage in STAGES}
    step = sum(mean.values())
    row.update(oom=False, steps=len(timed), first_step_seconds=sum(timings[0].values()), seconds_per_step=step,
               stage_seconds=mean, stage_shares={k: v / step for k, v in mean.items()},
               peak_host_rss_gib=rss_peak_bytes() / 2**30, host_rss_gib=rss_bytes() / 2**30,
               tokens_per_step=int(batch.attention_mask.sum()), synced_gib_per_step=receiver.bytes / (steps + 1) / 2**30)
    if device.type == "cuda":
        row.update(peak_gpu_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                   peak_gpu_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
                   gpu=torch.cuda.get_device_name(device))
    row["peak_mib_note"] = f"host RSS includes pinned Adam moments; MIB={MIB}"
    return row


def _step(actor, publisher, batch, device) -> dict:
    seconds = {}
    for stage, work in (("old_logprobs", lambda: actor.compute_logprobs(batch)),
                        ("actor_update", lambda: actor.update(batch)),
                        ("weight_sync", lambda: publisher.push(actor.version))):
        _sync(device)
        start = time.perf_counter()
        work()
        _sync(device)
        seconds[stage] = time.perf_counter() - start
    return seconds


def _child(args) -> int:
    row = run_config(args.child, args.steps, args.device, args.set)
    print("ROW " + json.dumps(row))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="8b,1.7b,8b-none", help=f"comma-separated, of {sorted(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every config")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    rows = []
    for name in args.configs.split(","):
        steps = 1 if name == "8b-none" else args.steps
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(steps), "--device", args.device,
               "--set", *args.set]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(lines[-1][4:]) if lines else {"config": name, "failed": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    print(_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def _table(rows: list[dict]) -> str:
    lines = ["| config | params | s/step | old_logprobs | actor_update | weight_sync | peak GPU alloc / reserved GiB "
             "| peak host RSS GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("failed") or r.get("oom"):
            lines.append(f"| {r['config']} | {r.get('parameters', 0) / 1e9:.2f}B | "
                         f"{'OOM' if r.get('oom') else 'failed'} | | | | "
                         f"{r.get('peak_gpu_allocated_gib', float('nan')):.1f} | |")
            continue
        shares = " | ".join(f"{r['stage_seconds'][s]:.2f} s ({100 * r['stage_shares'][s]:.0f}%)" for s in STAGES)
        lines.append(f"| {r['config']} | {r['parameters'] / 1e9:.2f}B | {r['seconds_per_step']:.2f} | {shares} | "
                     f"{r.get('peak_gpu_allocated_gib', 0):.1f} / {r.get('peak_gpu_reserved_gib', 0):.1f} | "
                     f"{r['peak_host_rss_gib']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
