"""Random test inputs shared by the algorithm tests."""
from __future__ import annotations

import torch


def random_mask(B: int, L: int, gen: torch.Generator, holes: bool = True) -> torch.Tensor:
    """Right-padded [B, L] mask with 1..L valid tokens per row and, optionally, masked
    holes inside the response (multi-turn observation tokens); every row keeps ≥ 1 token."""
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    mask = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).double()
    if holes:
        holes_mask = torch.rand(B, L, generator=gen) < 0.2
        holes_mask[torch.arange(B), 0] = False  # keep the first token
        mask = mask * (~holes_mask)
    return mask


def random_groups(B: int, gen: torch.Generator) -> torch.Tensor:
    """Shuffled group labels with groups of mixed sizes (including singletons)."""
    ids, g = [], 0
    while len(ids) < B:
        size = int(torch.randint(1, 5, (1,), generator=gen))
        ids.extend([g * 7 + 3] * size)  # arbitrary, non-contiguous labels
        g += 1
    ids = torch.tensor(ids[:B])
    return ids[torch.randperm(B, generator=gen)]
