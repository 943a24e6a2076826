"""Padding-free layout for the trainer's forward: each prompt once, each distinct response prefix once.

A GRPO micro-batch [B, P + L] is mostly padding when answers are short: prompts are left-padded
to P, responses right-padded to the longest L, and the last response token is never an input
(nothing after it is predicted). And the n responses of one prompt often repeat each other (the
same answer, or the same first digits): a token's state depends only on its prompt and the
response tokens before it, so rows that agree up to token t have the same states up to t.
``pack_rows`` lays the same tokens out as a few packed sequences ("bins") instead:

    bin = [prompt g (real tokens only), the prefix tree of g's response inputs, prompt h, ..., pad]

where a row's response inputs are its response tokens except the last (the state predicting
response token 0 is the prompt's last state, token t's is the state at response input t - 1),
and the tree holds one node per distinct prefix r[:t] (t >= 1) of the group's responses, parents
before children, its token r[t - 1] at position len(prompt) + t - 1. A 4D mask makes every token
see exactly what it sees in the padded batch: a prompt token the earlier tokens of its prompt, a
response node its prompt and its ancestors (= the earlier tokens of any row through it). Position
ids count real tokens as ``position_ids_from_mask`` does, so RoPE is the same. Each row's token t
reads the state of its own node, so a shared node's state feeds several rows' log-probs and its
gradient is their sum, as in the padded batch where each row computes that state itself. The
model's arithmetic per token is unchanged; only which positions get computed (no padding, no
repeated prefix) and the grouping in the matmuls and softmax sums differ, so results agree to
float32 rounding. On the issue-8 batch (16 prompts x 8 answers of <= 6 tokens) the tree holds
~250 tokens where one slot per response input needs ~450 (bench/RESULTS.md).

Used for short sequences only (``max_bin_tokens``): the mask is dense [bins, T, T], and with long
responses packing several into one bin would cost more attention than the padding it saves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PAD_GROUP = -1  # group id of a bin's tail padding
SHARE_RESPONSE_PREFIXES = True  # False: one node per row and token (no sharing), for benchmarks and tests


@dataclass
class PackedRows:
    """The packed layout of B rows (shapes: nb bins of T tokens, N = real response tokens).

    input_ids, position_ids [nb, T] long; attention [nb, 1, T, T] bool (True: may attend; the
    diagonal is always True so no query row is empty, which would give NaN).
    state_index [N]: flat index into [nb * T] of the state predicting each real response token.
    token_index [N]: flat index into [B * L] of that token; targets [N]: its id.
    Rows sharing a response prefix share its states: state_index may repeat a slot.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: torch.Tensor
    state_index: torch.Tensor
    token_index: torch.Tensor
    targets: torch.Tensor


def response_lengths(attention_mask: torch.Tensor, prompt_length: int) -> Optional[torch.Tensor]:
    """[B] real response tokens per row, or None when a row's response is not a contiguous prefix
    of its response region (then the padded layout is the only faithful one)."""
    resp = attention_mask[:, prompt_length:].bool()
    lengths = resp.sum(-1)
    prefix = torch.arange(resp.shape[1], device=resp.device) < lengths[:, None]
    return lengths if bool((prefix == resp).all()) else None


def _groups(prompt_rows: list[tuple]) -> list[list[int]]:
    """Rows grouped by identical prompt (ids and mask), in order of first appearance."""
    index: dict[tuple, int] = {}
    groups: list[list[int]] = []
    for row, key in enumerate(prompt_rows):
        if key not in index:
            index[key] = len(groups)
            groups.append([])
        groups[index[key]].append(row)
    return groups


def _bins(sizes: list[int], capacity: int) -> list[list[int]]:
    """Groups into ceil(total / capacity) bins, balanced (largest group first, into the least
    filled bin), so the bins, which are padded to the fullest, carry little padding. A group
    never splits; a bin may pass ``capacity`` by less than one group."""
    count = max(1, -(-sum(sizes) // capacity))
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for group in sorted(range(len(sizes)), key=lambda g: -sizes[g]):
        b = load.index(min(load))
        bins[b].append(group)
        load[b] += sizes[group]
    return [sorted(b) for b in bins if b]


def prefix_nodes(responses: list[list[int]], share: bool = True) -> dict[tuple, int]:
    """The prefix tree of one group's response inputs: each distinct prefix r[:t], 1 <= t < len(r),
    of ``responses`` -> its index, in order of first appearance (so a parent precedes its children).
    Keys are ``(owner, *prefix)``: owner 0 when rows ``share`` nodes, else the row's index in
    ``responses`` (every row its own chain: the layout without prefix sharing)."""
    nodes: dict[tuple, int] = {}
    for row, response in enumerate(responses):
        for t in range(1, len(response)):
            nodes.setdefault((row * (not share), *response[:t]), len(nodes))
    return nodes


class _BinWriter:
    """Fills the bins' token lists, the tree links and the per-response-token indices, one group
    at a time."""

    def __init__(self, bins: int, width: int, responses: list[list[int]], length: int, share: bool):
        self.width, self.responses, self.L, self.share = width, responses, length, share
        self.tok, self.pos, self.grp = ([[fill] * width for _ in range(bins)] for fill in (0, 0, PAD_GROUP))
        self.prompt = [[False] * width for _ in range(bins)]
        self.links: list[tuple[int, int, int]] = []  # (bin, query slot, key slot): a node sees an ancestor
        self.state_index: list[int] = []
        self.token_index: list[int] = []
        self.targets: list[int] = []

    def add_group(self, b: int, at: int, g: int, prompt: list[int], rows: list[int], nodes: dict[tuple, int]) -> int:
        """Writes group ``g`` (its prompt, then its prefix tree ``nodes``) into bin ``b`` from slot
        ``at`` (``nodes`` from :func:`prefix_nodes` over ``rows``' responses, in that order); returns
        the next free slot."""
        n, base = len(prompt), b * self.width
        self.tok[b][at:at + n], self.pos[b][at:at + n], self.grp[b][at:at + n] = prompt, range(n), [g] * n
        self.prompt[b][at:at + n] = [True] * n
        last_prompt_state, start = base + at + n - 1, at + n
        for key, k in nodes.items():  # key = (owner, *prefix)
            slot, depth = start + k, len(key) - 1
            self.tok[b][slot], self.pos[b][slot], self.grp[b][slot] = key[-1], n + depth - 1, g
            self.links.extend((b, slot, start + nodes[key[:1 + d]]) for d in range(1, depth))
        for i, r in enumerate(rows):
            response, owner = self.responses[r], i * (not self.share)
            for t in range(len(response)):  # token t: predicted by the prompt's last state, then by node r[:t]
                self.state_index.append(last_prompt_state if t == 0 else base + start + nodes[(owner, *response[:t])])
                self.token_index.append(r * self.L + t)
                self.targets.append(response[t])
        return start + len(nodes)

    def result(self, device, dtype) -> PackedRows:
        tensor = lambda x, kind=torch.long: torch.tensor(x, device=device, dtype=kind)  # noqa: E731
        return PackedRows(input_ids=tensor(self.tok, dtype), position_ids=tensor(self.pos),
                          attention=_attention(tensor(self.grp), tensor(self.prompt, torch.bool),
                                               tensor(self.links).view(-1, 3)),
                          state_index=tensor(self.state_index), token_index=tensor(self.token_index),
                          targets=tensor(self.targets, dtype))


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
              max_bin_tokens: int) -> Optional[PackedRows]:
    """The packed layout of a padded batch, or None when it does not apply (a group longer
    than ``max_bin_tokens``, or a response that is not a contiguous prefix)."""
    if max_bin_tokens <= 0 or int(attention_mask.sum(-1).max()) - 1 > max_bin_tokens:
        return None  # a row alone (its prompt + response inputs) would not fit: no list building
    lengths = response_lengths(attention_mask, prompt_length)
    if lengths is None:
        return None
    P = prompt_length
    ids, attn, lens = input_ids.tolist(), attention_mask.tolist(), lengths.tolist()
    groups = _groups([(tuple(ids[r][:P]), tuple(attn[r][:P])) for r in range(len(ids))])
    prompts = [[t for t, a in zip(ids[rows[0]][:P], attn[rows[0]][:P]) if a] for rows in groups]
    responses = [ids[r][P:P + lens[r]] for r in range(len(ids))]
    share = SHARE_RESPONSE_PREFIXES
    trees = [prefix_nodes([responses[r] for r in rows], share) for rows in groups]
    sizes = [len(prompt) + len(tree) for prompt, tree in zip(prompts, trees)]
    if max(sizes) > max_bin_tokens:
        return None
    bins = _bins(sizes, max_bin_tokens)
    writer = _BinWriter(len(bins), max(sum(sizes[g] for g in b) for b in bins), responses, len(ids[0]) - P, share)
    for b, members in enumerate(bins):
        at = 0
        for g in members:
            at = writer.add_group(b, at, g, prompts[g], groups[g], trees[g])
    return writer.result(input_ids.device, input_ids.dtype)


def _attention(group: torch.Tensor, prompt: torch.Tensor, links: torch.Tensor) -> torch.Tensor:
    """[nb, 1, T, T] bool from per-token group ids and prompt flags [nb, T] and tree links [K, 3]
    (bin, query, key): query i sees key j <= i of its own group that is a prompt token, the keys
    ``links`` names (a node's ancestors), and itself."""
    width = group.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=group.device).tril()
    same_group = (group[:, :, None] == group[:, None, :]) & (group[:, None, :] != PAD_GROUP)
    visible = same_group & prompt[:, None, :] & causal
    visible |= torch.eye(width, dtype=torch.bool, device=group.device)
    visible[links[:, 0], links[:, 1], links[:, 2]] = True
    return visible.unsqueeze(1)
