"""Padding-free layout for the trainer's forward: each prompt once, every response packed after it.

A GRPO micro-batch [B, P + L] is mostly padding when answers are short: prompts are left-padded
to P, responses right-padded to the longest L, and the last response token is never an input
(nothing after it is predicted). ``pack_rows`` lays the same tokens out as a few packed
sequences ("bins") instead:

    bin = [prompt g (real tokens only), response inputs of g's rows, prompt h, h's rows ..., pad]

where a row's response inputs are its response tokens except the last (the state predicting
response token 0 is the prompt's last state, token t's is the state at response input t - 1).
A 4D mask makes every token see exactly what it sees in the padded batch: a prompt token the
earlier tokens of its prompt, a response token its prompt and the earlier tokens of its own
response. Position ids count real tokens as ``position_ids_from_mask`` does, so RoPE is the same.
The model's arithmetic per token is unchanged; only which padding positions get computed (none)
and the grouping of rows in the matmuls differ, so results agree to float32 rounding.

Used for short sequences only (``max_bin_tokens``): the mask is dense [bins, T, T], and with long
responses packing several into one bin would cost more attention than the padding it saves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PAD_GROUP = -1  # group id of a bin's tail padding
PROMPT_ROW = -1  # row id of prompt tokens (shared by the group's rows)


@dataclass
class PackedRows:
    """The packed layout of B rows (shapes: nb bins of T tokens, N = real response tokens).

    input_ids, position_ids [nb, T] long; attention [nb, 1, T, T] bool (True: may attend; the
    diagonal is always True so no query row is empty, which would give NaN).
    state_index [N]: flat index into [nb * T] of the state predicting each real response token.
    token_index [N]: flat index into [B * L] of that token; targets [N]: its id.
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


class _BinWriter:
    """Fills the bins' token lists and the per-response-token indices, one group at a time."""

    def __init__(self, bins: int, width: int, ids: list[list[int]], lens: list[int], prompt_length: int):
        self.width, self.ids, self.lens, self.P = width, ids, lens, prompt_length
        self.L = len(ids[0]) - prompt_length
        self.tok, self.pos, self.grp, self.row = ([[fill] * width for _ in range(bins)]
                                                  for fill in (0, 0, PAD_GROUP, PROMPT_ROW))
        self.state_index: list[int] = []
        self.token_index: list[int] = []
        self.targets: list[int] = []

    def add_group(self, b: int, at: int, g: int, prompt: list[int], rows: list[int]) -> int:
        """Writes group ``g`` (its prompt, then each row's response inputs) into bin ``b`` from
        slot ``at``; returns the next free slot."""
        n, base = len(prompt), b * self.width
        self.tok[b][at:at + n], self.pos[b][at:at + n], self.grp[b][at:at + n] = prompt, range(n), [g] * n
        last_prompt_state, at = base + at + n - 1, at + n
        for r in rows:
            k = max(self.lens[r] - 1, 0)  # response inputs: all tokens but the last
            self.tok[b][at:at + k] = self.ids[r][self.P:self.P + k]
            self.pos[b][at:at + k] = range(n, n + k)
            self.grp[b][at:at + k], self.row[b][at:at + k] = [g] * k, [r] * k
            for t in range(self.lens[r]):  # token t: predicted by the prompt's last state, then by input t - 1
                self.state_index.append(last_prompt_state if t == 0 else base + at + t - 1)
                self.token_index.append(r * self.L + t)
                self.targets.append(self.ids[r][self.P + t])
            at += k
        return at

    def result(self, device, dtype) -> PackedRows:
        tensor = lambda x, kind=torch.long: torch.tensor(x, device=device, dtype=kind)  # noqa: E731
        return PackedRows(input_ids=tensor(self.tok, dtype), position_ids=tensor(self.pos),
                          attention=_attention(tensor(self.grp), tensor(self.row)),
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
    sizes = [len(prompt) + sum(max(lens[r] - 1, 0) for r in rows) for prompt, rows in zip(prompts, groups)]
    if max(sizes) > max_bin_tokens:
        return None
    bins = _bins(sizes, max_bin_tokens)
    writer = _BinWriter(len(bins), max(sum(sizes[g] for g in b) for b in bins), ids, lens, P)
    for b, members in enumerate(bins):
        at = 0
        for g in members:
            at = writer.add_group(b, at, g, prompts[g], groups[g])
    return writer.result(input_ids.device, input_ids.dtype)


def _attention(group: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """[nb, 1, T, T] bool from per-token group and row ids [nb, T]: query i sees key j <= i of its
    own group that is a prompt token or a token of its own row; every query sees itself."""
    width = group.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=group.device).tril()
    same_group = (group[:, :, None] == group[:, None, :]) & (group[:, None, :] != PAD_GROUP)
    visible = (row[:, None, :] == PROMPT_ROW) | (row[:, None, :] == row[:, :, None])
    eye = torch.eye(width, dtype=torch.bool, device=group.device)
    return ((same_group & visible & causal) | eye).unsqueeze(1)
