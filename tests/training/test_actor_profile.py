"""Actor.update names its phases for a profiler's trace (record_function ranges)."""
import copy

from torch.profiler import ProfilerActivity, profile

from asyncrl.config import load_config
from asyncrl.training.actor import Actor
from tests.training.test_actor_options import _batch

PHASES = ("actor/forward", "actor/loss", "actor/backward", "actor/clip_grad", "actor/metrics",
          "actor/optimizer_step", "actor/param_check")


def test_update_phases_appear_in_a_profile(tiny_policy):
    model, tok = tiny_policy
    cfg = load_config(None, [])
    actor = Actor(copy.deepcopy(model), cfg.actor, cfg.algorithm, temperature=1.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        metrics = actor.update(_batch(tok))
    names = {event.name for event in prof.events()}
    assert set(PHASES) <= names, set(PHASES) - names
    assert metrics["actor/skipped_step"] == 0.0 and isinstance(metrics["actor/pg_loss"], float)
