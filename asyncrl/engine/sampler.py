"""Sampler: temperature / top-k / top-p / greedy with batch-independent seeded noise,
returning the log-prob of each sampled token under the distribution sampled from.

Sampling is a Gumbel race: ``token = argmax(logp + g)`` with ``g = -log(-log(u))``,
which draws exactly from ``softmax(logp)``. ``u`` comes from a counter-based hash of
(row key, vocab index), where the row key mixes (seed, sample index, position). So a
row's token depends only on its own logits and key: never on the batch it shares, on
preemption, or on a global RNG state.

``logp = log_softmax(masked(logits / T))`` where the mask drops tokens outside top-k /
top-p; the returned log-prob is ``logp[token]`` (0 <= -logp; exactly what the trainer
must renormalise over for an importance ratio). Greedy rows (T == 0) take argmax and
report the T=1 log-prob of the argmax token.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Largest u below 1: ((2^24 - 1) + 0.5) rounds to 2^24 in fp32, so without this clamp one
# index in 2^24 got u == 1 and g == +inf: at a 151,936 vocab ~0.9% of rows then took a
# uniformly random token whatever its logit.
U_MAX = 1.0 - 2.0 ** -24


def _mix32(x):
    """Avalanche a 32-bit value held in int64 (products stay < 2^63: no overflow)."""
    x = x & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def row_keys(seeds, sample_index, positions):
    """The per-(seed, sample, position) keys ``[B]``: int64 ops only (seeds < 2^63), so
    the same function runs on host numpy arrays (the engine) and on torch tensors."""
    return position_keys(sequence_keys(seeds, sample_index), positions)


def sequence_keys(seeds, sample_index):
    """The (seed, sample) part of ``row_keys``: constant over a sequence's life, so a caller
    that keys many positions of a sequence (the speculative verify step) can keep it."""
    k = _mix32(seeds & _M32)
    k = _mix32(k ^ ((seeds >> 32) & _M32))
    return _mix32(k ^ (sample_index & _M32))


def position_keys(seq_keys, positions):
    """``row_keys`` from ``sequence_keys``: the key of each position."""
    return _mix32(seq_keys ^ (positions & _M32))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys ``[B]`` int64 -> Gumbel noise ``[B, vocab]`` fp32, a pure function of keys."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _mix32(keys[:, None] * 0x9E3779B1 + v[None, :])
    x = _mix32(x ^ (keys[:, None] >> 7))
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1]
    u = u.clamp(max=U_MAX)  # (0, 1): g stays finite
    return -torch.log(-torch.log(u))


def _mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf. logits ``[B, V]``
    (already temperature-scaled), top_k ``[B]`` int (<=0: off), top_p ``[B]`` float."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)
    drop = rank >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # keep a token if the mass strictly before it is < top_p (the first is always kept); rows
    # with top_p >= 1 keep everything: their fp32 cumulative sum can reach 1.0 before the tail
    before = probs.cumsum(-1) - probs
    drop = drop | ((before >= top_p[:, None]) & (top_p[:, None] < 1.0))
    drop_orig = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop_orig, float("-inf"))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           keys: torch.Tensor, use_filter: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[B, V]`` (any float dtype; computed in fp32), temperature ``[B]`` (0 = greedy),
    top_k ``[B]`` (<= 0: off), top_p ``[B]``, keys ``[B]`` int64
    -> (tokens ``[B]`` int64, logprobs ``[B]`` fp32)."""
    logits = logits.float()
    greedy = temperature <= 0
    logp = processed_logprobs(logits, temperature, top_k, top_p, use_filter)
    race = torch.argmax(logp + gumbel_noise(keys, logits.shape[-1]), dim=-1)
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), race)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, use_filter: bool) -> torch.Tensor:
    """The distribution ``sample`` draws from, as log-probs ``[B, V]`` fp32: log_softmax of the
    temperature-scaled logits with top-k / top-p applied (greedy rows: T = 1). The speculative
    verifier (``spec/verifier.py``) accepts drafts against exactly this distribution."""
    t = torch.where(temperature <= 0, 1.0, temperature)
    scaled = logits.float() / t[:, None]
    if use_filter:
        scaled = _mask_top_k_top_p(scaled, top_k, top_p)
    return torch.log_softmax(scaled, dim=-1)


class Sampler:
    """Wraps ``sample``; on CUDA it is compiled so the [B, V] elementwise chain (noise,
    softmax, race) fuses into a few kernels instead of ~20 full passes over [B, V].
    With ``triton`` (CUDA only), batches without top-k/top-p go to the one-pass Triton
    kernel (``triton_sampler``: the same tokens and log-probs, ~1 read of the logits);
    filtered batches keep the (compiled) torch path."""

    def __init__(self, device: torch.device, compile: bool = False, triton: bool = False):
        self.fn = sample
        if compile and device.type == "cuda":
            self.fn = torch.compile(sample, dynamic=True)
        self.fast = None
        if triton and device.type == "cuda":
            from asyncrl.engine.triton_sampler import sample_unfiltered
            self.fast = sample_unfiltered

    def __call__(self, logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, use_filter: bool):
        """floats ``[2, B]`` = (temperature, top_p); ints ``[2, B]`` int64 = (key, top_k):
        packed so a step needs two host->device copies. Keys come from the host
        (``row_keys`` on numpy): inside the compiled region inductor fused them into the
        [B, V] reduction, which then ran 30x slower on an H200."""
        if self.fast is not None and not use_filter:
            return self.fast(logits, floats[0], ints[0])
        return self.fn(logits, floats[0], ints[1], floats[1], ints[0], use_filter)
