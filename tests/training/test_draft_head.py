"""Draft-head training (training/draft_head.py): the training-time-test mask by hand, the loss
mask, and the refresh path of ``rollout.speculative`` (config -> engine dict)."""
import torch

from asyncrl.engine.spec.eagle_head import ttt_mask
from asyncrl.training.draft_head import DraftSample, _batch


def test_ttt_mask_matches_the_engine_draft_steps():
    # T = 4, pass 3: query p sees pass-1 keys q <= p - 2, the pass-2 key p - 1 and its own pass-3 key p
    m = ttt_mask(4, 3, "cpu").int()
    expected = torch.tensor([
        # pass 1       pass 2       pass 3
        [0, 0, 0, 0,  0, 0, 0, 0,  1, 0, 0, 0],
        [0, 0, 0, 0,  1, 0, 0, 0,  0, 1, 0, 0],
        [1, 0, 0, 0,  0, 1, 0, 0,  0, 0, 1, 0],
        [1, 1, 0, 0,  0, 0, 1, 0,  0, 0, 0, 1]])
    assert torch.equal(m, expected)
    assert torch.equal(ttt_mask(3, 1, "cpu"), torch.ones(3, 3).tril().bool())  # pass 1: plain causal


def test_loss_mask_counts_completion_predictions_only():
    ids, mask = _batch([DraftSample([1, 2, 3, 4, 5], 3), DraftSample([7, 8], 1)], "cpu")
    assert ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0]]
    # position p predicts token p + 1: the completion tokens 4, 5 (from position 2), and 8
    assert mask.int().tolist() == [[0, 0, 1, 1, 0], [1, 0, 0, 0, 0]]


def test_rollout_speculative_eagle_passes_the_head_to_the_engine():
    from asyncrl.config import load_config

    cfg = load_config("quickstart", ["rollout.speculative.method=eagle", "rollout.speculative.model=heads/v0"])
    spec = cfg.rollout.speculative.engine_dict()
    assert spec["method"] == "eagle" and spec["model"] == "heads/v0"
