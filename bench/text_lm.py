"""A language model with real structure in a few minutes: GSM8K text, a BPE tokenizer trained on it,
a Qwen3 trained from random init (bench/spec_trained_target.py's target and draft model).

    rows = gsm8k_rows(0)                                   # the GSM8K training split shipped in the package
    tok = train_tokenizer([document(r) for r in rows], 8192)
    stream = token_stream(tok, [document(r) for r in rows])
    model = new_lm(dict(SHAPES["qwen3-0.6b"]), max_pos=2304, device="cuda")
    record = train_lm(model, chunk(stream, 2304), batch=8, lr=6e-4, seconds=90)

The corpus is GSM8K (MIT, asyncrl/data/sets/gsm8k/LICENSE), which ships inside the package: the
device machine has no network and needs nothing carried. Documents are ``"Question: ...\\nAnswer:
..."`` joined by the end-of-text token (id 0, the engine benches' ``eos_token_id``) and cut into
fixed-length chunks that cross document boundaries (pretraining-style packing).
"""
from __future__ import annotations

import json
import math
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

EOS = "<|endoftext|>"  # id 0 in every tokenizer built here


def gsm8k_rows(split: int, limit: Optional[int] = None) -> list[dict]:
    """GSM8K's training (``split`` 0, 7,473 rows) or test (1, 1,319 rows) rows: question, answer."""
    from asyncrl.data.sources import preset_file

    with open(preset_file("gsm8k", split, "bench")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def prompt_text(row: dict) -> str:
    return f"Question: {row['question']}\nAnswer:"


def document(row: dict) -> str:
    return f"{prompt_text(row)} {row['answer']}"


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style: every byte string round-trips) of ``vocab_size`` tokens trained on
    ``texts``; ``EOS`` is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    assert tok.token_to_id(EOS) == 0
    return tok


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """Every text's ids followed by EOS, concatenated: ``[N]`` int64."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.long)


def chunk(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[N // seq_len, seq_len]`` consecutive windows of ``stream`` (the remainder dropped)."""
    n = stream.numel() // seq_len
    return stream[:n * seq_len].view(n, seq_len)


def new_lm(shape: dict, max_pos: int, device, seed: int = 0):
    """A randomly initialised fp32 Qwen3 of ``shape`` (``SHAPES``' keys: vocab, hidden, layers...)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(max_position_embeddings=max_pos, rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=0,
                      bos_token_id=0, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return model


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``x [B, T]`` (bf16 autocast on CUDA, fp32 softmax)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda):
        logits = model(input_ids=x).logits  # [B, T, V]
    # labels shifted instead of logits sliced: no copy of a [B, T - 1, V] slice (0.6B: ~11 GB in fp32)
    labels = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


@torch.no_grad()
def eval_loss(model, chunks: torch.Tensor, batch: int, device) -> float:
    """Mean loss over ``chunks [N, T]`` (batches of ``batch``)."""
    was = model.training
    model.eval()
    losses = [float(lm_loss(model, chunks[i:i + batch].to(device))) for i in range(0, len(chunks), batch)]
    model.train(was)
    return sum(losses) / max(len(losses), 1)


def train_lm(model, chunks: torch.Tensor, batch: int, lr: float, seconds: Optional[float] = None,
             steps: Optional[int] = None, seed: int = 0, warmup: int = 20,
             on_step: Optional[Callable[[int, float], None]] = None) -> dict:
    """AdamW on ``chunks [N, T]`` (shuffled, epoch after epoch) for ``seconds`` of wall time or
    ``steps`` steps (``steps`` wins: deterministic, for tests); lr: linear warm-up over ``warmup``
    steps, then cosine to 10% over the budget (the fraction of the time or of the steps used).
    Returns steps, tokens, seconds, tokens/s and the loss at the start and at the end (mean of the
    last 10 steps)."""
    if seconds is None and steps is None:
        raise ValueError("train_lm: give seconds or steps")
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    g = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(len(chunks), generator=g), 0
    losses, step, t0 = [], 0, time.perf_counter()
    while True:
        progress = step / steps if steps is not None else (time.perf_counter() - t0) / seconds
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        if pos + batch > len(order):
            order, pos = torch.randperm(len(chunks), generator=g), 0
        x = chunks[order[pos:pos + min(batch, len(order))]].to(device, non_blocking=True)
        pos += batch
        loss = lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 1 or step % 10 == 0 or (steps is not None and step == steps):
            losses.append((step, float(loss.detach())))  # a host sync every 10 steps, not every step
            if on_step is not None:
                on_step(step, losses[-1][1])
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)  # no gradients left behind for the engine's memory sizing
    model.eval()
    del opt
    tokens = step * batch * chunks.shape[1]
    return dict(steps=step, tokens=tokens, seconds=round(dt, 1), tokens_per_s=round(tokens / dt),
                loss_first=round(losses[0][1], 3), loss_last=round(losses[-1][1], 3), lr=lr, batch=batch,
                seq_len=chunks.shape[1])


def distinct_ngrams(rows: list[list[int]], n: int = 4) -> float:
    """Mean over rows of (distinct n-grams / n-grams) of each row's tokens: 1.0 = no n-gram repeats
    within a row; a row looping on a short cycle tends to 0."""
    ratios = []
    for r in rows:
        grams = [tuple(r[i:i + n]) for i in range(len(r) - n + 1)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return round(sum(ratios) / max(len(ratios), 1), 4)


def longest_repeat_suffix(rows: list[list[int]], window: int = 256) -> float:
    """Mean over rows of the share of each row's last ``window`` tokens that equal the token one
    period earlier, for the row's best period in 1..64: ~1.0 when the end of a row is a loop."""
    shares = []
    for r in rows:
        tail = r[-window:]
        best = 0.0
        for p in range(1, min(64, len(tail) - 1) + 1):
            same = sum(tail[i] == tail[i - p] for i in range(p, len(tail)))
            best = max(best, same / (len(tail) - p))
        shares.append(best)
    return round(sum(shares) / max(len(shares), 1), 4)
