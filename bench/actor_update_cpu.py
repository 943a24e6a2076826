"""The actor update on the issue-8 CPU setting: padded layout (before), packed layout without
prefix sharing (flat) and the packed prefix tree (now, the default).

    python bench/actor_update_cpu.py [--threads 1 2] [--repeats 30] [--json out.json]

One ``Actor.update`` (forward + backward + grad clip + fused AdamW) on a GRPO batch of the TRL
comparison (bench/peer_trl.py): the 789,760-parameter Qwen3, 15-token vocabulary, 16 prompts
x 8 responses of at most 6 tokens, the sync loss (PPO clip, token-mean) and the async one
(decoupled PPO, token-level behaviour weights). Responses are synthetic, shaped like the run's
(mean ~3.7 tokens): the right answer + EOS (60%), 1-4 wrong digits + EOS (30%), or 6 tokens
without EOS (10%), so the batch is padded to 6.

``before`` is the previous code path, selected by the module switches: the padded layout
(prompt once per group, its KV broadcast to the rows) and the head the code takes for big
logits (at a154e8e, the RESULTS row: chunked under activation checkpointing; since abfc72a,
with no entropy bonus, the hand-fused head op). ``flat`` is the packed layout with one slot per
row and response input (the default until the prefix tree, ``packing.SHARE_RESPONSE_PREFIXES``
off). ``after`` is the default: the packed layout where rows with equal response prefixes
share their states, and one plain head pass. All run in the same process, interleaved, on the
same batch; medians of ``--repeats`` after 3 warm-ups. Before timing, one update each way from
the same weights checks that the loss and the gradients agree with ``after`` (differences
printed). The synthetic batch shares fewer prefixes than the run's batches (~310 packed tokens
against ~250 in the run, bench/RESULTS.md), so ``after`` is conservative.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from asyncrl.config import TinyModelConfig, load_config  # noqa: E402
from asyncrl.data.char_tokenizer import build_char_tokenizer  # noqa: E402
from asyncrl.training import logprobs, packing  # noqa: E402
from asyncrl.training.actor import Actor  # noqa: E402
from asyncrl.training.batch import pad_prompt_response  # noqa: E402
from asyncrl.training.model import build_tiny_model  # noqa: E402
from asyncrl.types import TrainBatch  # noqa: E402
from peer_trl_asyncrl import ASYNC, SETTINGS, SYNC  # noqa: E402
from peer_trl_setting import CHARSET, MAX_NEW_TOKENS, build_task  # noqa: E402


LAYOUTS = ("before", "flat", "after")


@contextmanager
def layout(name: str):
    """``before``: padded layout + the big-logits head; ``flat``: packed, no prefix sharing;
    ``after``: the defaults."""
    saved = logprobs.PACK_BIN_TOKENS, logprobs.SMALL_LOGITS_BYTES, packing.SHARE_RESPONSE_PREFIXES
    if name == "before":
        logprobs.PACK_BIN_TOKENS, logprobs.SMALL_LOGITS_BYTES = 0, -1
    if name == "flat":
        packing.SHARE_RESPONSE_PREFIXES = False
    try:
        yield
    finally:
        logprobs.PACK_BIN_TOKENS, logprobs.SMALL_LOGITS_BYTES, packing.SHARE_RESPONSE_PREFIXES = saved


def synthetic_batch(tok, seed: int, prompts: int = 16, n: int = 8) -> TrainBatch:
    """A GRPO batch shaped like the run's: binary rewards, group-normalised advantages, behaviour
    log-probs a little off the trainer's (for the async loss's weights)."""
    rng = random.Random(seed)
    stream = build_task(seed).train_stream(seed=seed)
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    rows_p, rows_r, scores = [], [], []
    for _ in range(prompts):
        ex = next(stream)
        prompt = tok(ex.prompt)["input_ids"]
        for _ in range(n):
            u = rng.random()
            if u < 0.6:
                resp, score = [tok.convert_tokens_to_ids(c) for c in ex.answer] + [tok.eos_token_id], 1.0
            elif u < 0.9:
                resp, score = [rng.choice(digits) for _ in range(rng.randint(1, 4))] + [tok.eos_token_id], 0.0
            else:
                resp, score = [rng.choice(digits) for _ in range(MAX_NEW_TOKENS)], 0.0
            rows_p.append(prompt)
            rows_r.append(resp[:MAX_NEW_TOKENS])
            scores.append(score)
    ids, attn, mask, plen = pad_prompt_response(rows_p, rows_r, tok.pad_token_id)
    s = torch.tensor(scores).view(prompts, n)
    adv = ((s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + 1e-6)).view(-1, 1) * mask
    gen = torch.Generator().manual_seed(seed)
    batch = TrainBatch(input_ids=ids, attention_mask=attn, response_mask=mask, prompt_length=plen,
                       rollout_logprobs=-torch.rand(mask.shape, generator=gen) * mask,
                       token_versions=torch.zeros(mask.shape, dtype=torch.long), scores=s.view(-1),
                       group_ids=torch.arange(prompts).repeat_interleave(n))
    batch.advantages = adv.contiguous()
    return batch


def build_actor(mode: str, tok, seed: int) -> Actor:
    cfg = load_config("quickstart", [*SETTINGS, *(ASYNC if mode == "async" else SYNC)])
    model = build_tiny_model(TinyModelConfig(), tok, seed)
    return Actor(model, cfg.actor, cfg.algorithm, cfg.rollout.temperature)


def agreement(actor: Actor, batch: TrainBatch, name: str) -> dict[str, float]:
    """One update with layout ``name`` and one with ``after`` from the same weights and optimizer
    state: the loss, the (clipped) gradients the update leaves in ``.grad`` (max abs difference
    over max abs gradient) and the new weights. The first AdamW step is ~lr·sign(g), so weights
    whose gradient is ~0 can move by up to lr on rounding alone: the gradient is the honest
    comparison."""
    results = []
    # a deep-copied scheduler no longer sees its optimizer's step wrapper: torch warns, harmlessly
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step\\(\\)` has been overridden")
    for which in (name, "after"):
        twin = copy.deepcopy(actor)
        with layout(which):
            metrics = twin.update(batch)
        params = list(twin.model.parameters())
        results.append((metrics["actor/pg_loss"], [p.grad.clone() for p in params], [p.detach().clone() for p in params]))
    (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = results
    scale = max(float(g.abs().max()) for g in grads_a)
    return dict(loss_diff=abs(loss_a - loss_b),
                grad_rel_diff=max(float((a - b).abs().max()) for a, b in zip(grads_a, grads_b)) / scale,
                param_diff=max(float((a - b).abs().max()) for a, b in zip(params_a, params_b)))


def time_updates(actor: Actor, batch: TrainBatch, repeats: int) -> dict[str, list[float]]:
    times = {name: [] for name in LAYOUTS}
    for i in range(repeats + 3):
        for name in times:
            with layout(name):
                start = time.perf_counter()
                actor.update(batch)
                if i >= 3:  # warm-up
                    times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["sync", "async"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    tok = build_char_tokenizer(CHARSET, with_unk=False)
    batch = synthetic_batch(tok, args.seed)
    lengths = batch.response_mask.sum(-1)
    print(f"batch: {batch.batch_size} rows, prompt {batch.prompt_length}, response padded to "
          f"{batch.response_length}, mean length {float(lengths.mean()):.2f}")
    for name in LAYOUTS:
        with layout(name):
            packed = packing.pack_rows(batch.input_ids, batch.attention_mask, batch.prompt_length,
                                       logprobs.PACK_BIN_TOKENS) if logprobs.PACK_BIN_TOKENS else None
        if packed is not None:
            print(f"{name}: {int(packed.input_ids.numel())} packed token slots in {packed.input_ids.shape[0]} bins")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for mode in args.modes:
            actor = build_actor(mode, tok, args.seed)
            agree = {name: agreement(actor, batch, name) for name in ("before", "flat")}
            times = time_updates(actor, batch, args.repeats)
            ms = {name: 1000 * statistics.median(times[name]) for name in LAYOUTS}
            rows.append(dict(threads=threads, mode=mode, **{f"{k}_ms": v for k, v in ms.items()},
                             speedup=ms["before"] / ms["after"], speedup_vs_flat=ms["flat"] / ms["after"],
                             repeats=args.repeats, agreement_with_after=agree))
            print(f"threads {threads} {mode:5s}: before {ms['before']:6.1f} ms, flat {ms['flat']:6.1f} ms, after "
                  f"{ms['after']:6.1f} ms: {ms['before'] / ms['after']:.2f}x / {ms['flat'] / ms['after']:.2f}x "
                  f"(median of {args.repeats})")
            for name, a in agree.items():
                print(f"    {name} vs after: |d loss| {a['loss_diff']:.1e}, grads {a['grad_rel_diff']:.1e} rel, "
                      f"params {a['param_diff']:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, mean_response_length=float(lengths.mean()),
                                                   padded_length=batch.response_length), indent=2))


if __name__ == "__main__":
    main()
