"""Trainer forward + backward with the prompt run once per GRPO group vs once per row.

    python bench/actor_prefix_sharing.py [--prompts 16] [--n 8] [--repeats 20]

Times ``response_logprobs`` + backward on a quickstart-shaped batch (1-3 digit addition
prompts, n responses each, the 0.79M Qwen3) both ways in the same run, interleaved.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from asyncrl.config import load_config
from asyncrl.data.char_tokenizer import build_char_tokenizer
from asyncrl.data.tasks import ArithmeticTask
from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.logprobs import response_logprobs
from asyncrl.training.model import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = ArithmeticTask(seed=0)
    tok = build_char_tokenizer(task.charset)
    model = build_tiny_model(load_config("quickstart").model.tiny, tok, seed=0)
    rng = random.Random(0)
    examples = task.eval_examples()[:args.prompts]
    prompts = [tok(ex.prompt)["input_ids"] for ex in examples for _ in range(args.n)]
    responses = [[rng.randint(4, len(tok) - 1) for _ in range(rng.randint(1, 5))] + [tok.eos_token_id]
                 for _ in prompts]
    ids, attn, mask, plen = pad_prompt_response(prompts, responses, tok.pad_token_id)
    times = {True: [], False: []}
    for i in range(args.repeats + 2):
        for shared in (True, False):
            model.zero_grad()
            start = time.perf_counter()
            lp, _ = response_logprobs(model, ids, attn, plen, share_prompts=shared)
            (lp * mask).sum().backward()
            if i >= 2:  # warm-up
                times[shared].append(time.perf_counter() - start)
    shared, per_row = statistics.median(times[True]), statistics.median(times[False])
    print(f"batch {args.prompts} prompts x {args.n}: per-row prompt {1000 * per_row:.1f} ms, "
          f"shared prompt {1000 * shared:.1f} ms, speedup {per_row / shared:.2f}x (median of {args.repeats})")


if __name__ == "__main__":
    main()
