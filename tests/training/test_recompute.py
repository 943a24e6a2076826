"""The recomputation of a checkpointed layer runs under the switches its forward ran under
(the attention implementation and the routes are covered in test_varlen.py and
test_routing_replay.py, with gradients)."""
import threading

from asyncrl.training.kernels import liger_rope_active, liger_rope_enabled
from asyncrl.training.recompute import checkpoint_contexts


def test_liger_rope_switch_is_put_back_for_the_recomputation(tiny_policy):
    """Liger's RoPE switch is a ContextVar: off after the forward, and at its default in
    autograd's CUDA thread, where the recomputation runs."""
    model, _ = tiny_policy
    with liger_rope_enabled(True):
        _, recompute = checkpoint_contexts(model)
    seen = []

    def backward_thread():
        seen.append(liger_rope_active())
        with recompute:
            seen.append(liger_rope_active())
        seen.append(liger_rope_active())

    thread = threading.Thread(target=backward_thread)
    thread.start()
    thread.join()
    assert seen == [False, True, False]
