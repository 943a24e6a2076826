import torch

from asyncrl.training.logprob_gap import LogprobGap, gap_metrics, logprob_gap_metrics


def test_mean_is_token_weighted_across_micro_batches_and_ignores_padding():
    gap = LogprobGap()
    # micro 1: 3 response tokens with gaps 0.1, 0.2, 0.3 and a padded token with a huge gap
    gap.add(torch.tensor([[-1.0, -2.0, -3.0, 0.0]]), torch.tensor([[-1.1, -2.2, -3.3, -50.0]]),
            torch.tensor([[1, 1, 1, 0]]))
    # micro 2: 1 token with gap 0.6
    gap.add(torch.tensor([[-0.4]]), torch.tensor([[-1.0]]), torch.tensor([[1]]))
    m = gap.metrics()
    assert abs(m["rollout/logprob_gap"] - (0.1 + 0.2 + 0.3 + 0.6) / 4) < 1e-6
    assert abs(m["rollout/logprob_gap_max"] - 0.6) < 1e-6


def test_nothing_added_gives_no_metrics():
    assert LogprobGap().metrics() == {}
    assert logprob_gap_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3)) == {}


def test_add_keeps_device_tensors_and_padding_inf_or_nan_stays_out():
    gap = LogprobGap()
    gap.add(torch.tensor([[-1.0, 0.0, 0.0]]), torch.tensor([[-1.5, -float("inf"), float("nan")]]),
            torch.tensor([[1, 0, 0]]))
    gap.add(torch.tensor([[-2.0, -3.0]]), torch.tensor([[-2.25, -3.0]]), torch.tensor([[1.0, 1.0]]))
    assert isinstance(gap._sums, torch.Tensor)  # nothing read back by add()
    total, tokens, largest = gap.totals()
    assert all(isinstance(v, float) for v in (total, tokens, largest))
    assert (total, tokens, largest) == (0.75, 3.0, 0.5)
    assert gap.metrics() == {"rollout/logprob_gap": 0.25, "rollout/logprob_gap_max": 0.5}


def test_ranks_merge_through_the_float_totals():
    a, b = LogprobGap(), LogprobGap()
    a.add(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([[1]]))
    b.add(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.25, -1.0]]), torch.tensor([[1, 1]]))
    parts = [a.totals(), b.totals()]
    merged = gap_metrics(sum(p[0] for p in parts), sum(p[1] for p in parts), max(p[2] for p in parts))
    assert merged == {"rollout/logprob_gap": 0.75 / 3, "rollout/logprob_gap_max": 0.5}
    assert gap_metrics(0.0, 0.0, 0.0) == {} and LogprobGap().totals() == (0.0, 0.0, 0.0)
