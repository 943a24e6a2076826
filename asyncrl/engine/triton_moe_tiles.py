"""Tile shapes for the fused-MoE grouped GEMM (``triton_moe.py``): a small table per layer shape.

Like vLLM's ``fused_moe/configs/E=..,N=..,device_name=...json`` (one file per expert count,
intermediate size and device, keyed by token count), re-derived for our kernels: here a row is
keyed by the layer shape ``(E, I, H)`` and a bucket of routed (token, expert) pairs, and names

- ``block_m``: pairs per tile, shared by both GEMMs (``align_pairs`` pads each expert's run to it);
  a tile reads a ``BLOCK_N x K`` slice of one expert's weights for ``block_m`` pairs, so at decode
  (few pairs per expert, weight-bandwidth bound) it should just hold one expert's pairs, and at
  prefill (~1,000 pairs per expert, compute bound) be large so weights are re-read less often;
- per GEMM (``up``: ``x W13^T`` with SiLU(gate)*up fused, one program owning the gate *and* up
  columns ``[n, n + BLOCK_N)``, so its weight tile is ``2 x BLOCK_N`` rows; ``down``: ``h W2^T``):
  ``block_n`` (the split over N: how many programs share one expert's work, which keeps the 132
  SMs of an H200 busy when few experts are hit), ``block_k``, ``num_warps``, ``num_stages``;
- ``backend``: ``"triton"`` or ``"grouped_mm"`` (``torch._grouped_mm``: CUTLASS grouped GEMM on
  sm90+ for bf16, as transformers 5's MoE uses), the faster at that size.

The 30B row starts from vLLM's published H200 config for E=128, N=768 (BLOCK_SIZE_N of their
unfused gate-up GEMM halved for our fused one, whose tile holds gate and up rows); vLLM keys by
tokens, we by pairs (tokens x top-8). ``bench/moe_gemm_tune.py`` sweeps candidates on a GPU
and prints the row to paste here; ``--offline`` compiles every row for sm90 without a GPU and
prints its shared memory and registers. Shapes not in the table get ``default_tiles``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmTile:
    """Launch shape of one grouped GEMM: ``block_n x block_k`` weight tiles, Triton's warps/stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeTiles:
    """The tiles of one MoE layer call. Invariant: both GEMMs use ``block_m`` (one alignment)."""

    block_m: int
    up: GemmTile
    down: GemmTile
    backend: str = "triton"

    def __post_init__(self):
        if self.backend not in ("triton", "grouped_mm"):
            raise ValueError(f"MoeTiles.backend must be 'triton' or 'grouped_mm', got {self.backend!r}")


# (E, I, H) -> ((max pairs, tiles), ...) ascending; the last row (max None) covers every larger call.
TILE_TABLE: dict[tuple[int, int, int], tuple[tuple[int | None, MoeTiles], ...]] = {
    # Qwen3-30B-A3B (and Qwen3-MoE shapes with the same experts): hidden 2048, moe_intermediate 768,
    # 128 experts, top-8. vLLM H200 E=128,N=768 rows used: M=8, 48, 128, 256, 512, >=1024 tokens.
    (128, 768, 2048): (
        (64, MoeTiles(16, GemmTile(32, 128, 4, 3), GemmTile(64, 128, 4, 3))),  # <= 8 tokens
        (512, MoeTiles(16, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3))),  # <= 64
        (1024, MoeTiles(16, GemmTile(64, 128, 4, 2), GemmTile(128, 128, 4, 2))),  # <= 128
        (2048, MoeTiles(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3))),  # <= 256: decode (*)
        (8192, MoeTiles(64, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3))),  # <= 1024
        (None, MoeTiles(128, GemmTile(128, 64, 8, 4), GemmTile(256, 64, 8, 4), "grouped_mm")),  # prefill
    ),
    # (*) vLLM's row there translates to up 128x128 / down 256x128 with 2 stages; compiled for sm90
    # (``bench/moe_gemm_tune.py --offline``) those take 255 registers per thread (the down GEMM
    # with stack use) where the halved tiles take ~140: the sweep measures both.
}


def default_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """Tiles for a layer shape not in the table, from the mean pairs per expert alone (vLLM's
    ``get_default_config`` idea): block_m just above it at decode, 128 from 64 pairs per expert
    on; torch's grouped GEMM from 256 per expert on (prefill)."""
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 8:
        return MoeTiles(16, GemmTile(64, 64), GemmTile(64, 64))
    if per_expert <= 24:
        return MoeTiles(32, GemmTile(64, 64), GemmTile(64, 64))
    if per_expert <= 64:
        return MoeTiles(64, GemmTile(64, 64), GemmTile(128, 64))
    backend = "grouped_mm" if per_expert >= 256 else "triton"
    return MoeTiles(128, GemmTile(64, 64, 8, 3), GemmTile(128, 64, 8, 3), backend)


def pick_tiles(num_pairs: int, num_experts: int, inter: int, hidden: int) -> MoeTiles:
    """The table row for ``(num_experts, inter, hidden)`` whose bucket holds ``num_pairs``, else
    ``default_tiles``. Shapes only, no data: one choice per captured CUDA-graph batch size."""
    rows = TILE_TABLE.get((num_experts, inter, hidden))
    if rows is None:
        return default_tiles(num_pairs, num_experts)
    for max_pairs, tiles in rows:
        if max_pairs is None or num_pairs <= max_pairs:
            return tiles
    raise AssertionError("the last row of a TILE_TABLE entry must have max pairs None")
