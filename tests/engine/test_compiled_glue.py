"""``decoder._CudaCompiled``: one compiled copy per dtype signature and grad mode, so a process
mixing them cannot exhaust one function's recompile budget (dynamo then runs it eagerly, silently:
on an H200 the engine's workload (a) fell from 47k to 28k tok/s). Runs on CPU through dynamo's
eager backend (the guards and the budget are dynamo's, whatever the backend)."""
import pytest
import torch
from torch._dynamo.utils import counters

from asyncrl.engine.models import decoder


@pytest.fixture
def cpu_compiled(monkeypatch):
    monkeypatch.setattr(decoder._CudaCompiled, "device_types", ("cpu",))
    monkeypatch.setattr(decoder._CudaCompiled, "compile_options", {"backend": "eager"})
    torch._dynamo.reset()
    counters.clear()
    yield decoder._CudaCompiled(decoder._rms_norm)
    torch._dynamo.reset()


def mixed_calls(fn) -> None:
    """Two dtypes x five situations (rows, a strided view, training with grad): ten guard
    sets, more than dynamo's 8 per code object; each result checked against eager."""
    for dtype in (torch.bfloat16, torch.float32):
        for rows, strided, grad in ((4, False, False), (1, False, False), (4, True, False), (4, False, True),
                                    (1, False, True)):
            x = torch.randn(rows, 64, dtype=dtype)
            x = x[:, ::2] if strided else x[:, :32]
            w = torch.randn(32, dtype=dtype, requires_grad=grad)
            with torch.set_grad_enabled(grad):
                torch.testing.assert_close(fn(x, w, 1e-6), decoder._rms_norm(x, w, 1e-6))


def recompile_limit_hits() -> int:
    return sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason.lower())


def test_one_shared_compiled_function_hits_the_recompile_limit(cpu_compiled):
    """The control: what the engine did before (one torch.compile of the function)."""
    mixed_calls(torch.compile(decoder._rms_norm, dynamic=True, backend="eager"))
    assert recompile_limit_hits() > 0


def test_copies_per_dtype_and_grad_mode_stay_within_the_limit(cpu_compiled):
    mixed_calls(cpu_compiled)
    assert recompile_limit_hits() == 0
    assert len(cpu_compiled.variants) == 4  # {bf16, fp32} x {no grad, grad}
    codes = {fn._torchdynamo_orig_callable.__code__ for fn in cpu_compiled.variants.values()}
    assert len(codes) == 4 and decoder._rms_norm.__code__ not in codes
