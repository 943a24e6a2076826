"""model_runner's graph-input fill: the copies a graphed decode step makes into its CUDA graph's buffers."""
import pytest
import torch

from asyncrl.engine import model_runner
from asyncrl.engine.model_runner import fill_graph_inputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_fill_graph_inputs_copies_every_pair_of_mixed_dtypes(device, kernel, monkeypatch):
    """Views of larger buffers (as the graph's ``[:rows]`` views and the staging buffer's typed views), int64,
    int32 (2-D block tables) and fp32 mixed in one call: each destination equals its source, nothing else
    of the buffers changes."""
    monkeypatch.setattr(model_runner, "KERNEL_INPUT_COPIES", kernel)
    g = torch.Generator().manual_seed(0)
    bufs = [torch.zeros(8, dtype=torch.int64), torch.zeros(8, 5, dtype=torch.int32), torch.zeros(8),
            torch.zeros(8, dtype=torch.int64)]
    bufs = [b.to(device) for b in bufs]
    srcs = [torch.randint(0, 1000, (6,), generator=g), torch.randint(0, 99, (6, 5), generator=g, dtype=torch.int32),
            torch.rand(6, generator=g), torch.randint(0, 2 ** 40, (6,), generator=g)]
    srcs = [s.to(device) for s in srcs]
    fill_graph_inputs([b[:6] for b in bufs], srcs)
    for b, s in zip(bufs, srcs):
        assert torch.equal(b[:6], s) and not b[6:].any()
