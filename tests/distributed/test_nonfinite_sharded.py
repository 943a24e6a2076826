"""A loss that is not finite on one rank only: the actor's backward runs on every rank (no
host read of the loss before it), the "loss not finite" flag travels with the step's summed
metrics, and every rank skips the same optimizer step: no hang, no NaN in the weights. An
infinite loss with finite gradients (``inf``) is caught by that flag alone: the grad norm is finite."""
import math
from pathlib import Path

import pytest
import torch

from tests.distributed import cases
from tests.distributed.ranks import run_ranks


def _rank(rank: int, world: int, out_dir: str, kind: str) -> None:
    import asyncrl.training.actor as actor_module

    real = actor_module.compute_policy_loss

    def nan_on_rank_1(name, inp, cfg):
        out = real(name, inp, cfg)
        if rank == 1:  # NaN: NaN gradients too; inf: a constant, so the gradients stay finite
            out.loss = out.loss * math.nan if kind == "nan" else out.loss + math.inf
        return out

    _, (actor, _, _) = cases.build(["actor.micro_batch_size=2"], sharded=True, meta=rank > 0)
    batch = cases.make_batch("uneven")
    before = cases._named(actor.forward_module, grads=False)
    actor_module.compute_policy_loss = nan_on_rank_1
    try:
        metrics = actor.update(batch)
    finally:
        actor_module.compute_policy_loss = real
    after = cases._named(actor.forward_module, grads=False)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    torch.save({"metrics": metrics, "unchanged": unchanged}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path, kind):
    run_ranks(2, tmp_path, _rank, str(tmp_path), kind)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for result in results:
        metrics = result["metrics"]
        assert metrics["actor/skipped_step"] == 1.0 and result["unchanged"]
        assert 0 < metrics["actor/nonfinite_loss"] < 1  # rank 1's rows only, weighted by their share
        assert "actor/_nonfinite_micros" not in metrics
    assert results[0]["metrics"]["actor/nonfinite_loss"] == results[1]["metrics"]["actor/nonfinite_loss"]
    assert math.isnan(results[0]["metrics"]["actor/grad_norm"]) == (kind == "nan")
    # the logprob gap (the update's own forward: no old log-probs) merged over the ranks as floats
    gaps = [r["metrics"]["rollout/logprob_gap"] for r in results]
    assert gaps[0] == gaps[1] and gaps[0] >= 0
