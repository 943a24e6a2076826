"""The varlen layout's key gather with a backward that needs no atomics.

``varlen_attention`` gathers each sequence's keys and values from the T tokens into K key slots
(``rows.key_index``: a row's slots are its group's prompt tokens, then its own inputs). The
gather's autograd backward, ``index_add_`` of [K, Hkv, D] into [T, Hkv, D], ran at ~240 GB/s in
bf16 on an H200 (bf16 atomics; 593 us a call, 33 ms of a 0.47 s GRPO update at the issue-8 shape:
bench/RESULTS.md, issue 20). The layout knows where each token's slots are (``SlotMap``), so
the backward is two gathers and one fp32 sum instead:

- every token has exactly one slot in its own sequence (``first_slot``): ``grad_x = grad[first_slot]``;
- a prompt token also has one slot in each row of its group that has inputs
  (``extra_slots`` [P, W], padded with -1): those are summed in fp32 and added once.

Deterministic (no atomics), and one bf16 rounding per token instead of one per slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlotMap:
    """Where each token's key slots are. first_slot [T] long: the token's slot in its own sequence.
    extra_tokens [P] long: tokens with more slots (prompt tokens of groups with inputs), unique.
    extra_slots [P, W] long: their other slots, -1 padded. Invariant: first_slot and the
    non-negative entries of extra_slots together list every slot of key_index exactly once."""

    first_slot: torch.Tensor
    extra_tokens: torch.Tensor
    extra_slots: torch.Tensor


class _GatherKeySlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, key_index: torch.Tensor, slots: SlotMap) -> torch.Tensor:
        ctx.slots = slots
        return x.index_select(0, key_index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return scatter_slots(grad, ctx.slots), None, None


def scatter_slots(grad: torch.Tensor, slots: SlotMap) -> torch.Tensor:
    """grad [K, ...] of the key slots -> [T, ...]: each token's slot gradients summed."""
    out = grad.index_select(0, slots.first_slot)
    if slots.extra_tokens.numel():
        padded = slots.extra_slots
        gathered = grad.index_select(0, padded.clamp(min=0).view(-1)).view(*padded.shape, *grad.shape[1:])
        keep = (padded >= 0).view(*padded.shape, *([1] * (grad.dim() - 1)))
        acc = torch.promote_types(grad.dtype, torch.float32)  # bf16 slots summed in fp32, rounded once
        extra = torch.where(keep, gathered, 0).sum(1, dtype=acc)
        total = out.index_select(0, slots.extra_tokens).to(acc) + extra
        out.index_copy_(0, slots.extra_tokens, total.to(out.dtype))
    return out


def gather_key_slots(x: torch.Tensor, key_index: torch.Tensor, slots: SlotMap | None) -> torch.Tensor:
    """x [T, Hkv, D] -> [K, Hkv, D] = x[key_index]; its backward is ``scatter_slots`` when the
    layout's ``slots`` are known (else ``index_select``'s own)."""
    if slots is None or not torch.is_grad_enabled() or not x.requires_grad:
        return x.index_select(0, key_index)
    return _GatherKeySlots.apply(x, key_index, slots)
