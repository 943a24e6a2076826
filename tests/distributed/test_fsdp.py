"""FSDP2 data parallelism computes exactly the one-process step (SCALE.md §5): at 2 and 4 gloo
ranks, for every loss aggregation mode (with KL and entropy terms), groups of unequal length
split unevenly, a mini-batch boundary inside a group, a rank whose rows hold no valid token, a
rank with no row at all, and at 2 ranks activation checkpointing, both offload modes and the
critic, the loss, every gradient (gathered), the log-probs and the updated weights equal the
single-process run's to 1e-6 (fp32; the weights wherever the gradient is outside Adam's noise
amplification range, see cases.assert_weights_close)."""
import pytest
import torch

from tests.distributed import cases

TOL = 1e-6


def _assert_close(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= TOL * max(1.0, want[name].abs().max().item()), f"{what} {name}: max |diff| {err:.2e}"


def _check(result: dict, reference: dict, case: str):
    assert result["metrics"]["actor/pg_loss"] == pytest.approx(reference["metrics"]["actor/pg_loss"], abs=TOL)
    if "actor/kl_loss" in reference["metrics"]:
        assert result["metrics"]["actor/kl_loss"] == pytest.approx(reference["metrics"]["actor/kl_loss"], abs=TOL)
    assert result["metrics"]["actor/grad_norm"] == pytest.approx(reference["metrics"]["actor/grad_norm"], rel=TOL)
    for key in ("logprobs", "ref_logprobs"):
        if key in reference:
            assert (result[key] - reference[key]).abs().max() <= TOL, f"{case} {key}"
    _assert_close(result["grads"], reference["grads"], f"{case} gradient")
    cases.assert_weights_close(result["weights"], reference["weights"], reference["grads"], f"{case} weight")
    if "critic" in reference:
        assert (result["values"] - reference["values"]).abs().max() <= TOL
        assert result["critic"]["critic/vf_loss"] == pytest.approx(reference["critic"]["critic/vf_loss"], abs=TOL)
        cases.assert_weights_close(result["critic_weights"], reference["critic_weights"], reference["critic_grads"],
                                   f"{case} critic weight")


@pytest.mark.parametrize("case", list(cases.CASES))
def test_two_ranks_equal_one_process(world2, single_process, case):
    _check(world2[case], single_process[case], case)


@pytest.mark.parametrize("case", cases.FOUR_RANK_CASES)
def test_four_ranks_equal_one_process(world4, single_process, case):
    _check(world4[case], single_process[case], case)


def test_the_cases_are_not_trivial(single_process):
    """The steps really move the weights, and the empty-rank batch does have an empty share."""
    metrics = single_process["token-mean"]["metrics"]
    assert metrics["actor/clipfrac"] > 0 and metrics["actor/kl_loss"] != 0
    batch = cases.make_batch("empty_rank")
    assert batch.response_mask[:3].sum() == 0 and batch.response_mask[3:].sum() > 0
    moved = [(single_process["token-mean"]["weights"][k] - w).abs().max().item()
             for k, w in cases.tiny_model().named_parameters()]
    assert min(moved) > 0
