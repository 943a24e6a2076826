"""The fused-MoE tile table: buckets in order, rows found at their boundaries, and every tile's
software pipeline within an H200's shared memory (the kernels themselves: test_triton_moe.py)."""
import pytest

from asyncrl.engine.triton_moe_tiles import TILE_TABLE, GemmTile, MoeTiles, default_tiles, pick_tiles

SMEM_BYTES = 227 * 1024  # per thread block on sm90 (H100/H200)


def _pipeline_bytes(block_m: int, tile: GemmTile, weight_tiles: int, elem: int = 2) -> int:
    """Shared memory of Triton's pipelined loop: num_stages x (A tile + weight tiles), bf16."""
    return tile.num_stages * (block_m * tile.block_k + weight_tiles * tile.block_n * tile.block_k) * elem


def _all_tiles():
    for rows in TILE_TABLE.values():
        yield from (t for _, t in rows)
    for per_expert in (1, 16, 48, 100, 300):
        yield default_tiles(per_expert * 8, 8)


def test_table_rows_ascend_and_end_open():
    for shape, rows in TILE_TABLE.items():
        bounds = [m for m, _ in rows]
        assert bounds[-1] is None, shape
        assert bounds[:-1] == sorted(bounds[:-1]) and len(set(bounds[:-1])) == len(bounds) - 1, shape


def test_pick_tiles_uses_the_bucket_holding_the_pairs():
    (e, i, h), rows = next(iter(TILE_TABLE.items()))
    for (bound, tiles), (_, next_tiles) in zip(rows, rows[1:]):
        assert pick_tiles(bound, e, i, h) == tiles
        assert pick_tiles(bound + 1, e, i, h) == next_tiles
    assert pick_tiles(10 ** 9, e, i, h) == rows[-1][1]
    assert pick_tiles(64, e + 1, i, h) == default_tiles(64, e + 1)  # another shape: the defaults


def test_defaults_grow_block_m_with_pairs_per_expert():
    heights = [default_tiles(n * 64, 64).block_m for n in (1, 8, 9, 24, 25, 64, 65, 1000)]
    assert heights == [16, 16, 32, 32, 64, 64, 128, 128]
    assert default_tiles(255 * 64, 64).backend == "triton" and default_tiles(256 * 64, 64).backend == "grouped_mm"


@pytest.mark.parametrize("tiles", list(_all_tiles()), ids=str)
def test_every_tile_fits_shared_memory_and_tensor_cores(tiles: MoeTiles):
    for tile, weight_tiles in ((tiles.up, 2), (tiles.down, 1)):
        for n in (tiles.block_m, tile.block_n, tile.block_k):
            assert n >= 16 and n & (n - 1) == 0  # tl.dot: powers of two, >= 16
        assert tile.num_warps in (4, 8) and 1 <= tile.num_stages <= 5
        assert _pipeline_bytes(tiles.block_m, tile, weight_tiles) <= SMEM_BYTES, tile


def test_bad_backend_is_named():
    with pytest.raises(ValueError, match="backend"):
        MoeTiles(16, GemmTile(64, 64), GemmTile(64, 64), "cutlass")
