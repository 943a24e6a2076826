"""Weight-sync helpers that need no backend (the probe and sync paths are in test_async.py)."""


def test_probe_tolerance_defaults_by_dtype_and_an_explicit_value_wins():
    from asyncrl.runtime.weight_sync import probe_tolerance

    assert probe_tolerance(None, "float32") == 1e-3
    assert probe_tolerance(None, "bfloat16") == probe_tolerance(None, "float16") == 0.1
    assert probe_tolerance(0.02, "bfloat16") == 0.02
