"""Host<->device staging: packed arrays come back equal, in any dtype mix, step after step."""
import numpy as np
import pytest
import torch

from asyncrl.engine.staging import DeviceToHost, HostToDevice

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_put_and_read_round_trip(device):
    dev = torch.device(device)
    h2d, d2h = HostToDevice(dev), DeviceToHost(dev)
    rng = np.random.default_rng(0)
    handles = []
    for step in range(5):  # more steps than buffers: slots are reused
        n = 3 + 7 * step  # odd sizes: offsets need alignment for int64 views
        arrays = [rng.integers(-2**62, 2**62, n), rng.integers(0, 2**31 - 1, (n, 5)).astype(np.int32),
                  rng.standard_normal((2, n)).astype(np.float32), rng.integers(0, 9, 1)]
        out = h2d.put(arrays)
        for a, t in zip(arrays, out):
            assert t.device.type == device and t.shape == a.shape
            assert np.array_equal(t.cpu().numpy(), a)
        tokens = torch.tensor(arrays[0][:n] % 151936, device=dev)
        handles.append((d2h.start(tokens, out[2][0]), tokens.tolist(), out[2][0].tolist()))
        if len(handles) == 2:  # read one step late, as the engine does
            h, toks, lps = handles.pop(0)
            got_t, got_l = d2h.read(h)
            assert got_t == toks and np.allclose(got_l, lps)
