"""One AdamW step on the quickstart's 0.79M Qwen3: torch's default (a loop over 46 tensors on
CPU) vs the fused kernel the trainer now uses (asyncrl/training/optim.py).

    python bench/adamw_fused.py [--threads 1] [--repeats 50]

Both optimizers hold their own copy of the same parameters and gradients; steps alternate
(interleaved), medians reported. Also checks that both copies stay equal to rounding.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from asyncrl.config import TinyModelConfig
from asyncrl.data.char_tokenizer import build_char_tokenizer
from asyncrl.training.model import build_tiny_model
from asyncrl.training.optim import adamw


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    plain_model = build_tiny_model(TinyModelConfig(), build_char_tokenizer("0123456789+=", with_unk=False), 0)
    fused_model = copy.deepcopy(plain_model)
    for a, b in zip(plain_model.parameters(), fused_model.parameters()):
        a.grad = torch.randn_like(a) * 1e-2
        b.grad = a.grad.clone()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-4, weight_decay=0.0)
    fused = adamw(fused_model.parameters(), lr=1e-4, weight_decay=0.0)
    times = {"plain": [], "fused": []}
    for i in range(args.repeats + 3):
        for name, opt in (("plain", plain), ("fused", fused)):
            start = time.perf_counter()
            opt.step()
            if i >= 3:
                times[name].append(time.perf_counter() - start)
    gap = max(float((a - b).abs().max()) for a, b in zip(plain_model.parameters(), fused_model.parameters()))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"AdamW step, {sum(p.numel() for p in plain_model.parameters()):,} params in "
          f"{len(list(plain_model.parameters()))} tensors, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}: "
          f"plain {1000 * med['plain']:.2f} ms, fused {1000 * med['fused']:.2f} ms "
          f"({med['plain'] / med['fused']:.1f}x); max |param difference| after {args.repeats + 3} steps {gap:.1e}")


if __name__ == "__main__":
    main()
