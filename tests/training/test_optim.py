import pytest
import torch

from asyncrl.training.optim import adamw, supports_fused


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train(model, optimizer, steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def test_fused_on_cpu_float_parameters():
    opt = adamw(_model(0).parameters(), lr=1e-3)
    assert opt.defaults["fused"] is True


def test_fused_steps_equal_the_plain_adamw_to_rounding():
    a, b = _model(0), _model(0)
    _train(a, adamw(a.parameters(), lr=1e-2, betas=[0.9, 0.95], weight_decay=0.1))
    _train(b, torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))
    moved = max((pa - p0).abs().max() for pa, p0 in zip(a.parameters(), _model(0).parameters()))
    assert moved > 1e-3  # the steps did something
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_integer_parameters_fall_back_to_the_default():
    assert not supports_fused([torch.zeros(2, dtype=torch.long)])
    assert not supports_fused([])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_supported_dtypes(dtype):
    assert supports_fused([torch.zeros(2, dtype=dtype)])
