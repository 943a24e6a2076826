"""learning_metrics drops what measures the machine and keeps every learning metric."""
from asyncrl.metrics.measured import learning_metrics


def test_timing_memory_and_async_queue_metrics_are_dropped_learning_ones_kept():
    row = {"step": 3, "reward/mean": 0.5, "actor/loss": -0.1, "actor/grad_norm": 1.2, "kl/ref": 0.0,
           "time/rollout": 0.4, "share/rollout": 0.6, "throughput/tokens_per_s": 900.0,
           "memory/peak_gib": 1.5, "async/version_lag": 1, "async/staleness_max": 1,
           "async/buffer_groups": 4, "weight_sync/seconds": 0.01, "actor/tflops": 0.2, "actor/mfu": 0.01,
           "health/throughput_drop": 0.0, "async/groups_timed_out": 0}
    assert learning_metrics(row) == {"step": 3, "reward/mean": 0.5, "actor/loss": -0.1, "actor/grad_norm": 1.2,
                                     "kl/ref": 0.0, "async/groups_timed_out": 0}
