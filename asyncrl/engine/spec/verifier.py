"""The exact speculative acceptance rule (Leviathan et al., arXiv 2211.17192), on the device.

A sequence proposes ``n <= K`` draft tokens ``x_1..x_n``; one target forward over its last
token and the drafts gives ``K + 1`` rows of logits, row ``j`` predicting the token at
position ``start + j + 1``. Every row goes through the sampler's transform (temperature,
top-k, top-p: ``sampler.processed_logprobs``), giving the target distribution ``p_j``.
Drafts are accepted left to right; the first rejection emits one corrected token and stops;
if all ``n`` are accepted a bonus token is drawn from ``p_n``. Each step emits ``a + 1``
tokens (``a`` accepted), distributed exactly as sampling from ``p`` one token at a time.

Two paths, chosen per call:

* **one-hot drafts** (n-gram lookup, argmax drafts of a draft model: the
  draft distribution ``q`` is a point mass). The rule is "accept ``x_j`` with probability
  ``p_j(x_j)``; on rejection draw from ``p_j`` with ``x_j`` removed". We realise it with the
  sampler's own keyed Gumbel race: ``t_j = argmax(logp_j + g_j)`` is the token the plain
  sampler draws at that position, ``x_j`` is accepted iff ``x_j == t_j`` (probability
  ``p_j(x_j)``) and a rejection emits ``t_j`` (given ``t_j != x_j`` it is distributed as
  ``p_j`` without ``x_j``, renormalised). Same acceptance rate as the textbook rule, and the
  emitted tokens are exactly those of speculation off (vLLM MRV2's "strict" variant), up to
  the low-bit differences between a (k+1)-token forward and k+1 one-token ones. Greedy rows
  (T = 0) are the special case ``t_j = argmax`` of the raw logits.
* **probabilistic drafts** (a draft sampled from its own distribution ``q``): accept iff
  ``q(x_j) > 0`` and ``u_j * q(x_j) <= p_j(x_j)``; the first rejection emits a token from
  ``norm(max(0, p_j - q_j))``; all accepted: the bonus ``t_n``. Greedy rows use the one-hot
  path (their ``p`` is a point mass on the argmax).

Randomness is keyed like the sampler's: the key of row ``j`` is ``row_keys(seed, sample
index, position of the token drawn)``; ``g_j = gumbel_noise(key_j)`` drives both the race and
the residual draw (only one of them is ever used at a position), ``u_j`` is a salted hash of
the same key (independent of ``g_j``). A run with speculation is reproducible from its seeds.

Every emitted token carries ``logp_j[token]``: the TARGET's processed log-prob at its
position (never ``q``, never the residual distribution: the token's marginal is ``p_j``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from asyncrl.engine.sampler import _mix32, gumbel_noise, processed_logprobs, sample

# Salts keep the acceptance uniforms and the draft model's own sampling noise independent of
# the target's Gumbel noise at the same (seed, sample, position) key.
ACCEPT_SALT = 0x5BD1E995
DRAFT_SALT = 0x27D4EB2F


def salted(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """Another stream of keys ``[...]`` int64 (< 2^32) from ``keys``, a pure function."""
    return _mix32(keys ^ salt)


def acceptance_uniform(keys: torch.Tensor) -> torch.Tensor:
    """keys ``[...]`` int64 -> u ``[...]`` fp32 in (0, 1): the acceptance draw of each row."""
    x = _mix32(salted(keys, ACCEPT_SALT) * 0x9E3779B1)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class VerifyResult:
    """tokens ``[B, K+1]`` int64 and logprobs ``[B, K+1]`` fp32: row b's first
    ``num_emitted[b]`` entries are its emitted tokens (accepted drafts, then the corrected or
    bonus token) and their target log-probs; ``num_emitted [B]`` int64 in ``[1, n_b + 1]``."""
    tokens: torch.Tensor
    logprobs: torch.Tensor
    num_emitted: torch.Tensor


def verify(logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
           temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, keys: torch.Tensor,
           draft_probs: Optional[torch.Tensor] = None, use_filter: bool = True,
           sampled: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> VerifyResult:
    """logits ``[B, K+1, V]`` (any float dtype), draft_ids ``[B, K]`` int64, num_drafts ``[B]``
    int64 (drafts past it are ignored), temperature / top_k / top_p ``[B]`` (the request's),
    keys ``[B, K+1]`` int64 (row j: the key of position ``start + j + 1``), draft_probs
    ``[B, K, V]`` fp32 (q of each draft position) or None for one-hot drafts.
    ``sampled``: (tokens, logprobs) ``[B * (K+1)]`` the plain sampler drew at every position
    with these keys (the engine passes its fused sampler's); drawn here with
    ``sampler.sample`` when None."""
    B, K1, V = logits.shape
    K = K1 - 1
    if sampled is None:  # the plain sampler's token at every position: the one-hot answer and the bonus
        rep = (lambda x: x.repeat_interleave(K1))
        sampled = sample(logits.reshape(B * K1, V), rep(temperature), rep(top_k), rep(top_p), keys.reshape(-1),
                         use_filter)
    t_tok, t_lp = sampled[0].view(B, K1), sampled[1].view(B, K1)
    j = torch.arange(K, device=logits.device)
    valid = j[None, :] < num_drafts[:, None]
    if draft_probs is None:
        accepted = _leading(valid & (draft_ids == t_tok[:, :K]))
        return VerifyResult(t_tok, t_lp, accepted + 1)
    return _verify_probabilistic(logits, draft_ids, num_drafts, valid, temperature, top_k, top_p, keys,
                                 draft_probs, use_filter, t_tok, t_lp)


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` bool -> ``[B]`` int64: the length of each row's leading run of True."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.int64, device=ok.device)
    return ok.to(torch.int64).cumprod(1).sum(1)


def _verify_probabilistic(logits, draft_ids, num_drafts, valid, temperature, top_k, top_p, keys, draft_probs,
                          use_filter, t_tok, t_lp) -> VerifyResult:
    B, K1, V = logits.shape
    K = K1 - 1
    rep = (lambda x: x.repeat_interleave(K1))
    logp = processed_logprobs(logits.reshape(B * K1, V), rep(temperature), rep(top_k), rep(top_p),
                              use_filter).view(B, K1, V)
    p = logp[:, :K].exp()
    q = draft_probs.float()
    px = p.gather(2, draft_ids[..., None]).squeeze(2)
    qx = q.gather(2, draft_ids[..., None]).squeeze(2)
    u = acceptance_uniform(keys[:, :K])
    greedy = (temperature <= 0)[:, None]
    ok = torch.where(greedy, draft_ids == t_tok[:, :K], (qx > 0) & (u * qx <= px))
    accepted = _leading(valid & ok)
    # the corrected token at every draft position: a Gumbel race over log max(0, p - q)
    residual = (p - q).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p <= q everywhere (p == q): never rejected; guard
    log_r = torch.where(empty, logp[:, :K], residual.log())
    g = gumbel_noise(keys[:, :K].reshape(-1), V).view(B, K, V)
    recovered = torch.argmax(log_r + g, dim=-1)
    recovered = torch.where(greedy, t_tok[:, :K], recovered)
    # row b emits drafts [0, a), then at a: recovered (a < n) or the bonus t_tok (a == n)
    pos = torch.arange(K1, device=logits.device)[None, :]
    a = accepted[:, None]
    padded_drafts = torch.cat([draft_ids, t_tok[:, K:]], 1)
    padded_rec = torch.cat([recovered, t_tok[:, K:]], 1)
    at_a = torch.where(a < num_drafts[:, None], padded_rec, t_tok)
    tokens = torch.where(pos < a, padded_drafts, torch.where(pos == a, at_a, t_tok))
    logprobs = logp.gather(2, tokens[..., None]).squeeze(2)
    # greedy rows keep the sampler's log-prob convention (T = 1 of the argmax token)
    logprobs = torch.where(greedy, t_lp, logprobs)
    return VerifyResult(tokens, logprobs, accepted + 1)
