"""AdamW with its moments in host memory takes exactly torch's AdamW steps (same kernel), chunk
by chunk, keeps the moments on the CPU, and round-trips its state dict."""
import copy

import torch

from asyncrl.training.host_adamw import HostAdamW


def _params(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(7, 5), (5,), (3, 3, 2)]]


def _run(optimizer_cls, steps: int = 4, **kwargs):
    params = _params(0)
    optimizer = optimizer_cls(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return params, optimizer


def test_same_steps_as_torch_adamw():
    want, _ = _run(torch.optim.AdamW, fused=True)
    for chunk_bytes in (1, 64, 1 << 20):  # one parameter per chunk, a few, all at once
        got, optimizer = _run(HostAdamW, chunk_bytes=chunk_bytes)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert all(s["exp_avg"].device.type == "cpu" and s["exp_avg_sq"].device.type == "cpu"
                   for s in optimizer.state.values())


def test_state_dict_round_trip_continues_identically():
    params, optimizer = _run(HostAdamW, steps=2)
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = HostAdamW(clone, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as through a file
    for group_params, opt in ((params, optimizer), (clone, restored)):
        for p in group_params:
            p.grad = torch.ones_like(p)
        opt.step()
    for a, b in zip(params, clone):
        assert torch.equal(a, b)
    assert all(s["exp_avg"].device.type == "cpu" for s in restored.state.values())
