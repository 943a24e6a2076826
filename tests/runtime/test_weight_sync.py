"""Weight-sync helpers that need no backend (the probe and sync paths are in test_async.py)."""


def test_probe_tolerance_defaults_by_dtype_and_an_explicit_value_wins():
    from asyncrl.runtime.weight_sync import probe_tolerance

    assert probe_tolerance(None, "float32") == 1e-3
    assert probe_tolerance(None, "bfloat16") == probe_tolerance(None, "float16") == 0.1
    assert probe_tolerance(0.02, "bfloat16") == 0.02


class _DeferredBackend:
    """A backend whose every weight load fails (as when its rollout process died)."""
    version = 0

    def start_update(self, named_tensors, version):
        list(named_tensors)

        def loaded():
            raise RuntimeError("the rollout process died")
        return loaded

    def run_probe(self, probe, version):
        raise AssertionError("not reached")


def test_close_raises_a_failed_deferred_load_unless_the_run_already_failed():
    import pytest
    import torch

    from asyncrl.runtime.weight_sync import GenerationGate, WeightSync

    model = torch.nn.Linear(2, 2)
    for raise_pending in (True, False):
        sync = WeightSync(_DeferredBackend(), GenerationGate(), probe=None, inflight=True)
        sync.push(model, 1)
        if raise_pending:
            with pytest.raises(RuntimeError, match="died"):
                sync.close()
        else:
            sync.close(raise_pending=False)  # the failure was reported already: not raised again
