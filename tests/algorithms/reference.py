"""Plain float64 reference implementations, written with Python loops over rows and
tokens, straight from docs/algorithms.md / ALGORITHMS.md. The package's vectorised code
is compared against these on random inputs."""
from __future__ import annotations

import math

import torch


def groups_of(group_ids):
    groups = {}
    for i, g in enumerate(group_ids.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def outcome(scores, mask, token_rewards=None):
    B = mask.shape[0]
    if token_rewards is None:
        return [float(scores[i]) for i in range(B)]
    return [sum(float(token_rewards[i, t]) for t in range(mask.shape[1]) if mask[i, t] > 0) for i in range(B)]


def mean(xs):
    return sum(xs) / len(xs)


def std_unbiased(xs):
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def broadcast(per_row, mask):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] > 0:
                out[i, t] = per_row[i]
    return out


def grpo(R, group_ids, mask, norm=True, eps=1e-6):
    adv = [0.0] * len(R)
    for idx in groups_of(group_ids).values():
        rs = [R[i] for i in idx]
        for i in idx:
            if len(idx) == 1:
                adv[i] = R[i]
            elif norm:
                adv[i] = (R[i] - mean(rs)) / (std_unbiased(rs) + eps)
            else:
                adv[i] = R[i] - mean(rs)
    return broadcast(adv, mask)


def rloo(R, group_ids, mask):
    adv = [0.0] * len(R)
    for idx in groups_of(group_ids).values():
        for i in idx:
            others = [R[j] for j in idx if j != i]
            adv[i] = R[i] - (mean(others) if others else 0.0)
    return broadcast(adv, mask)


def whiten(x, mask):
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t] > 0]
    mu = mean(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[i, t] > 0:
                out[i, t] = (float(x[i, t]) - mu) / math.sqrt(var + 1e-8)
    return out


def reward_to_go(rewards, mask, gamma):
    """G_t over valid tokens only: the next *valid* token's return is discounted once."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t] > 0:
                running = float(rewards[i, t]) + gamma * running
                out[i, t] = running
    return out


def rpp_baseline(R, group_ids, mask):
    centred = [0.0] * len(R)
    for idx in groups_of(group_ids).values():
        mu = mean([R[i] for i in idx]) if len(idx) > 1 else 0.0
        for i in idx:
            centred[i] = R[i] - mu
    return whiten(broadcast(centred, mask), mask)


def gae(rewards, values, mask, gamma, lam):
    B, L = mask.shape
    adv = torch.zeros((B, L), dtype=torch.float64)
    for i in range(B):
        valid = [t for t in range(L) if mask[i, t] > 0]
        next_v, next_a = 0.0, 0.0
        for t in reversed(valid):
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            next_a = delta + gamma * lam * next_a
            next_v = float(values[i, t])
            adv[i, t] = next_a
    returns = adv + values.double() * mask.double()
    return whiten(adv, mask), returns


def opo(R, group_ids, mask):
    lengths = [float(mask[i].sum()) for i in range(len(R))]
    adv = [0.0] * len(R)
    for idx in groups_of(group_ids).values():
        total = sum(lengths[i] for i in idx)
        b = sum(lengths[i] * R[i] for i in idx) / total if total > 0 and len(idx) > 1 else 0.0  # verl: singleton b = 0
        for i in idx:
            adv[i] = R[i] - b
    return broadcast(adv, mask)


def gpg(R, group_ids, mask):
    alpha = len(R) / max(1, sum(1 for r in R if r != 0))
    adv = [0.0] * len(R)
    for idx in groups_of(group_ids).values():
        mu = mean([R[i] for i in idx]) if len(idx) > 1 else 0.0
        for i in idx:
            adv[i] = alpha * (R[i] - mu)
    return broadcast(adv, mask)


def agg(loss, mask, mode, norm_length=None):
    B, L = mask.shape
    rows = [[float(loss[i, t]) for t in range(L) if mask[i, t] > 0] for i in range(B)]
    nonempty = [r for r in rows if r]
    n_tok = sum(len(r) for r in rows)
    if mode == "token-mean":
        return sum(map(sum, rows)) / max(n_tok, 1)
    if mode == "token-sum":
        return sum(map(sum, rows))
    S = max(len(nonempty), 1)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / S
    if mode == "seq-mean-token-sum":
        return sum(map(sum, rows)) / S
    if mode == "seq-mean-token-sum-norm":
        return sum(map(sum, rows)) / S / (L if norm_length is None else norm_length)
    raise ValueError(mode)


def ppo_token(lp, old, A, eps_lo, eps_hi, c):
    r = math.exp(max(min(lp - old, 20.0), -20.0))
    l1 = -A * r
    l2 = -A * min(max(r, 1 - eps_lo), 1 + eps_hi)
    lc = max(l1, l2)
    if c is not None and A < 0:
        return min(lc, -A * c)
    return lc


def elementwise(fn, *tensors):
    B, L = tensors[0].shape
    out = torch.zeros((B, L), dtype=torch.float64)
    for i in range(B):
        for t in range(L):
            out[i, t] = fn(*(float(x[i, t]) for x in tensors))
    return out


def gspo_loss_matrix(lp, old, A, mask, eps_lo, eps_hi):
    B, L = mask.shape
    out = torch.zeros((B, L), dtype=torch.float64)
    for i in range(B):
        valid = [t for t in range(L) if mask[i, t] > 0]
        if not valid:
            continue
        s = math.exp(min(sum(float(lp[i, t] - old[i, t]) for t in valid) / len(valid), 10.0))
        for t in range(L):
            a = float(A[i, t])
            out[i, t] = max(-a * s, -a * min(max(s, 1 - eps_lo), 1 + eps_hi))
    return out


def sapo_token(lp, old, A, tau_pos, tau_neg):
    r = math.exp(lp - old)
    tau = tau_pos if A > 0 else tau_neg
    return -(4 / tau) * (1 / (1 + math.exp(-tau * (r - 1)))) * A


def entropy(logits_row):
    m = max(logits_row)
    z = sum(math.exp(v - m) for v in logits_row)
    probs = [math.exp(v - m) / z for v in logits_row]
    return -sum(p * math.log(p) for p in probs if p > 0)
