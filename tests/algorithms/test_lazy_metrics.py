import pytest
import torch

from asyncrl.algorithms import PolicyLossConfig, PolicyLossInput, compute_policy_loss, rollout_is_weights
from asyncrl.algorithms.lazy_metrics import LazyMetrics


def test_reads_as_a_mapping_of_floats_and_gives_the_device_tensors():
    values = torch.tensor([0.25, 1.5, -2.0])
    m = LazyMetrics(("a", "b", "c"), values)
    assert list(m) == ["a", "b", "c"] and len(m) == 3 and "b" in m and "z" not in m
    assert torch.equal(m.stacked(), values)
    assert {k: float(v) for k, v in m.tensors().items()} == {"a": 0.25, "b": 1.5, "c": -2.0}
    assert all(t.dim() == 0 for t in m.tensors().values())
    assert m == {"a": 0.25, "b": 1.5, "c": -2.0} and dict(m) == {"a": 0.25, "b": 1.5, "c": -2.0}
    assert isinstance(m["a"], float)
    with pytest.raises(KeyError):
        m["z"]
    with pytest.raises(ValueError):
        LazyMetrics(("a",), values)


def test_losses_and_corrections_return_lazy_metrics_with_floats_on_read():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = compute_policy_loss("ppo_clip", PolicyLossInput(lp, old, torch.ones(1, 3), mask), PolicyLossConfig())
    assert isinstance(out.metrics, LazyMetrics)
    assert set(out.metrics) == {"clipfrac", "clipfrac_lower", "ppo_kl", "ratio_mean"}
    assert out.metrics["ppo_kl"] == pytest.approx(((-1.2 + 1.0) + (-1.0 + 2.0)) / 2)
    _, m = rollout_is_weights(old, lp.detach(), mask)
    assert isinstance(m, LazyMetrics) and m["is_weight_max"] == pytest.approx(torch.exp(torch.tensor(1.0)).item())


def test_the_weight_max_of_an_empty_mask_or_tensor_is_zero():
    _, m = rollout_is_weights(torch.full((2, 3), -1.0), torch.zeros(2, 3), torch.zeros(2, 3))
    assert m["is_weight_max"] == 0.0
    _, m = rollout_is_weights(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3))
    assert m["is_weight_max"] == 0.0
