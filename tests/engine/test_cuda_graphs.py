"""capture_graphs: largest bucket first, warm-up before each capture, one memory pool.

CPU: torch.cuda's graph classes replaced by recorders (the order of calls is the contract).
GPU: real graphs of a small forward replay what the eager forward computes.
"""
import pytest
import torch

from asyncrl.engine import cuda_graphs
from asyncrl.engine.cuda_graphs import capture_graphs


class _Recorder:
    """Stands in for torch.cuda's CUDAGraph / graph / synchronize and logs every call."""

    def __init__(self):
        self.log = []
        self.capturing = None
        recorder = self

        class Graph:
            def __init__(self):
                self.id = len([e for e in recorder.log if e[0] == "graph"])
                recorder.log.append(("graph", self.id))

            def pool(self):
                return f"pool-of-{self.id}"

        class Capture:
            def __init__(self, graph, pool):
                self.graph, self.pool = graph, pool

            def __enter__(self):
                recorder.capturing = self.graph
                recorder.log.append(("capture", self.graph.id, self.pool))

            def __exit__(self, *exc):
                recorder.capturing = None

        self.Graph, self.Capture = Graph, Capture

    def step(self, name):
        def run(bs):
            self.log.append(("run", name, bs, "captured" if self.capturing else "eager"))
        return run


def test_largest_first_warm_up_then_capture_all_in_the_first_pool(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(cuda_graphs.torch.cuda, "CUDAGraph", rec.Graph)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", rec.Capture)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "synchronize", lambda: rec.log.append(("sync",)))

    plain, cascade = capture_graphs([1, 4, 2], rec.step("plain"), rec.step("cascade"))

    assert sorted(plain) == sorted(cascade) == [1, 2, 4]
    runs = [e[1:] for e in rec.log if e[0] == "run"]
    # per size (4, 2, 1), per step: one eager run, then the same run under capture
    assert runs == [(name, bs, mode) for bs in (4, 2, 1) for name in ("plain", "cascade")
                    for mode in ("eager", "captured")]
    pools = [e[2] for e in rec.log if e[0] == "capture"]
    assert pools == [None] + ["pool-of-0"] * 5  # the first (largest) graph's pool serves the rest
    assert rec.log.count(("sync",)) == 6
    assert plain[4].id == 0 and cascade[1].id == 5


def test_before_warmup_runs_before_each_eager_warm_up_only(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(cuda_graphs.torch.cuda, "CUDAGraph", rec.Graph)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", rec.Capture)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "synchronize", lambda: None)

    capture_graphs([1, 2], rec.step("plain"), before_warmup=lambda bs: rec.log.append(("inputs", bs)))

    events = [e[:1] + e[2:] if e[0] == "run" else e for e in rec.log if e[0] in ("run", "inputs")]
    assert events == [("inputs", 2), ("run", 2, "eager"), ("run", 2, "captured"),
                      ("inputs", 1), ("run", 1, "eager"), ("run", 1, "captured")]


@pytest.mark.gpu
def test_replayed_buckets_equal_the_eager_forward():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8).cuda()
    x, y = torch.zeros(8, 16, device="cuda"), torch.zeros(8, 8, device="cuda")

    def forward(bs):
        y[:bs] = torch.relu(layer(x[:bs]))

    with torch.inference_mode():
        graphs, = capture_graphs([2, 8], forward)
        for bs in (2, 8):
            data = torch.randn(bs, 16, device="cuda")
            x[:bs].copy_(data)
            graphs[bs].replay()
            torch.testing.assert_close(y[:bs], torch.relu(layer(data)))
