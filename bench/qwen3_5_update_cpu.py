"""One GRPO actor update of the tiny Qwen3.5 (the quickstart_qwen3_5 recipe's model) on the CPU:
the trainer's path before issue 22's CPU work against now, in one process, on one batch.

    python bench/qwen3_5_update_cpu.py [--threads 1] [--repeats 10] [--json out.json]

``before``: transformers' torch functions as written (delta rule in 64-token chunks, ``F.conv1d``)
and every row with its prompt (hybrid models could not share the prompt's cache);
``forms``: the short-row forms of training/gdn_cpu.py, rows still padded with their prompts;
``now``: short-row forms + each prompt once, its KV and Gated DeltaNet states broadcast to its
rows (training/prompt_cache.py). The Qwen3 quickstart model's update (prefix-tree layout) is
timed beside them for scale. One ``Actor.update`` = forward + backward + clip + AdamW on 16
prompts x 8 responses of 1-3 digit addition (answers within +-1 of the sum, EOS-terminated).
Medians of ``--repeats`` after 2 warm-ups, the variants interleaved. Before timing, one update
each way from the same weights checks that the gradients agree with ``now``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import random
import statistics
import time
import warnings

import torch

from asyncrl.config import TinyModelConfig, load_config
from asyncrl.data.char_tokenizer import build_char_tokenizer
from asyncrl.training import hf_kernels, logprobs
from asyncrl.training.actor import Actor
from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.model import build_tiny_model
from asyncrl.types import TrainBatch


@contextlib.contextmanager
def variant(name: str):
    if name == "now" or name == "qwen3":
        yield
        return
    padded = logprobs._padded_states
    logprobs._padded_states = lambda base, ids, mask, plen, share, *rest: padded(base, ids, mask, plen, False, *rest)
    try:
        with (hf_kernels.transformers_torch_forms() if name == "before" else contextlib.nullcontext()):
            yield
    finally:
        logprobs._padded_states = padded


def grpo_batch(tok, seed: int = 0) -> TrainBatch:
    rng = random.Random(seed)
    prompts, responses, scores = [], [], []
    for _ in range(16):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        prompt = tok(f"{a}+{b}=")["input_ids"]
        for _ in range(8):
            answer = a + b + rng.randint(-1, 1)
            prompts.append(prompt)
            responses.append(tok(str(answer), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            scores.append(float(answer == a + b))
    ids, attn, mask, plen = pad_prompt_response(prompts, responses, tok.pad_token_id)
    size, length = mask.shape
    score = torch.tensor(scores).view(16, 8)
    adv = ((score - score.mean(-1, keepdim=True)) / (score.std(-1, keepdim=True) + 1e-6)).view(-1)
    return TrainBatch(input_ids=ids, attention_mask=attn, response_mask=mask, prompt_length=plen,
                      rollout_logprobs=torch.zeros(size, length), token_versions=torch.zeros(size, length).long(),
                      scores=score.view(-1), group_ids=torch.arange(16).repeat_interleave(8),
                      advantages=adv[:, None] * mask)


def actor_for(architecture: str, tok) -> Actor:
    cfg = load_config("quickstart", [])
    model = build_tiny_model(TinyModelConfig(architecture=architecture), tok, seed=0)
    return Actor(model, cfg.actor, cfg.algorithm, temperature=1.0)


def gradients(actor: Actor, batch: TrainBatch, name: str) -> list[torch.Tensor]:
    actor.model.train()
    actor.optimizer.zero_grad(set_to_none=True)
    mask = batch.response_mask
    with variant(name):
        actor._micro_loss(batch, float(mask.sum()), float((mask.sum(-1) > 0).sum()))
    return [p.grad.clone() for p in actor.model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*lr_scheduler.*")  # the Actor steps its scheduler itself
    tok = build_char_tokenizer()
    batch = grpo_batch(tok)
    base = actor_for("qwen3_5", tok)
    reference = gradients(base, batch, "now")
    max_diff = {name: max(float((g - r).abs().max()) for g, r in zip(gradients(base, batch, name), reference))
                for name in ("before", "forms")}
    actors = {name: copy.deepcopy(base) for name in ("before", "forms", "now")}
    actors["qwen3"] = actor_for("qwen3", tok)
    times: dict[str, list[float]] = {name: [] for name in actors}
    for rep in range(args.repeats + 2):
        for name, actor in actors.items():
            with variant(name):
                start = time.perf_counter()
                actor.update(batch)
                if rep >= 2:
                    times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    result = {"batch": list(batch.input_ids.shape), "threads": args.threads, "median_s": medians,
              "speedup_now_vs_before": medians["before"] / medians["now"], "grad_max_abs_diff_vs_now": max_diff}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
