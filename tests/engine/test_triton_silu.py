"""``triton_silu.silu_and_mul``: SwiGLU's ``silu(gate) * up`` in one Triton kernel against eager torch
(``F.silu(gate) * up``, what HF's MLP runs), alone and inside the engine's MLP.

On a GPU it runs natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) through the
Triton interpreter; otherwise the module is skipped.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from asyncrl.engine.triton_silu import silu_and_mul, silu_launch  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _eager(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,inter,launch", [(7, 48, (1, 16, 1)), (7, 48, (4, 32, 2)), (33, 24, (8, 8, 4)),
                                            (5, 40, None)])
def test_kernel_matches_eager_torch(dtype, T, inter, launch):
    """Equal to eager torch, which rounds silu to the model dtype before the product: a tile's partial rows
    and columns (T, inter not multiples of the tile) and strided rows (a view into a wider buffer); in bf16 /
    fp16 a value may sit one rounding step away (exp and the division round in the last fp32 bit on either
    side), in fp32 within a few ulps."""
    torch.manual_seed(T * inter)
    wide = (torch.randn(T, 2 * inter + 5, device=DEVICE) * 3).to(dtype)
    gate_up = wide[:, 2:2 + 2 * inter]
    out = silu_and_mul(gate_up, inter, launch=launch)
    ref = _eager(gate_up, inter)
    assert out.shape == (T, inter) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=3e-7, atol=1e-7)
        return
    differ = out != ref
    assert differ.float().mean().item() <= 0.01
    step = torch.finfo(dtype).eps  # one rounding step, relative
    assert ((out.float() - ref.float()).abs()[differ] <= 2 * step * ref.float().abs()[differ]).all()


def test_rounds_silu_before_the_product():
    """The kernel follows eager torch's two roundings, not one fused fp32 product: a case where they differ."""
    g = torch.tensor([[0.10009765625]], dtype=torch.bfloat16, device=DEVICE)  # once 0.263671875, twice 0.26171875
    u = torch.tensor([[5.0]], dtype=torch.bfloat16, device=DEVICE)
    gate_up = torch.cat([g, u], dim=1)
    once = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
    twice = _eager(gate_up, 1)
    assert not torch.equal(once, twice)  # the case separates the two rules
    assert torch.equal(silu_and_mul(gate_up, 1), twice)


def test_names_a_bad_layout():
    with pytest.raises(ValueError, match="is not"):
        silu_and_mul(torch.zeros(3, 10, device=DEVICE), 4)
    with pytest.raises(ValueError, match="contiguous columns"):
        silu_and_mul(torch.zeros(8, 3, device=DEVICE).t(), 2)


def test_launch_rule_covers_every_row_count():
    for tokens in (1, 7, 188, 256, 257, 4096, 16384, 100_000):
        block_t, block_c, warps = silu_launch(tokens)
        assert block_t >= 1 and block_c >= 1 and warps >= 1
        assert block_t & (block_t - 1) == 0 and block_c & (block_c - 1) == 0  # Triton's tiles are powers of two
