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


@pytest.mark.parametrize("device", DEVICES)
def test_static_inputs_keep_their_addresses_and_take_one_copy(device):
    """Per-bucket layouts on one buffer: views never move (a captured graph reads them), ``put``
    writes every array of the bucket, and a bucket's missing array is named."""
    from asyncrl.engine.staging import StaticInputs

    layouts = {bs: {"ids": ((bs, 3), np.int64), "ctx": ((bs,), np.int32), "temp": ((bs,), np.float32)}
               for bs in (1, 4)}
    staged = StaticInputs(layouts, torch.device(device))
    views = {bs: staged.views(bs) for bs in layouts}
    rng = np.random.default_rng(0)
    for step in range(3):
        for bs in (4, 1):
            arrays = {"ids": rng.integers(-2**62, 2**62, (bs, 3)), "ctx": rng.integers(0, 99, bs),
                      "temp": rng.standard_normal(bs)}
            staged.put(bs, arrays)
            for name, v in staged.views(bs).items():
                assert v.data_ptr() == views[bs][name].data_ptr()
                assert np.array_equal(v.cpu().numpy(), np.asarray(arrays[name], dtype=layouts[bs][name][1]))
    with pytest.raises(KeyError, match="temp"):
        staged.put(1, {"ids": np.zeros((1, 3)), "ctx": np.zeros(1)})


def test_typed_views_read_each_array_from_its_offset():
    """The device side of ``HostToDevice.put`` on any byte buffer (here the CPU's): arrays of mixed
    dtypes and shapes packed at 16-byte offsets come back equal through the cached typed views,
    also on a second call that reuses the cache."""
    from asyncrl.engine.staging import _ALIGN, typed_views

    rng = np.random.default_rng(1)
    arrays = [rng.integers(-2**62, 2**62, 5), rng.integers(0, 2**31 - 1, (3, 7)).astype(np.int32),
              rng.standard_normal((2, 3)).astype(np.float32), rng.integers(0, 9, 1), np.zeros(0, np.int64)]
    offs, total = [], 0
    for a in arrays:
        offs.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    buf = np.zeros(total + _ALIGN, dtype=np.uint8)
    for a, o in zip(arrays, offs):
        buf[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev, typed = torch.from_numpy(buf), {}
    for _ in range(2):
        for a, t in zip(arrays, typed_views(dev, typed, arrays, offs)):
            assert t.shape == a.shape and np.array_equal(t.numpy(), a)
    assert set(typed) == {np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32)}


@pytest.mark.parametrize("device", DEVICES)
def test_packed_read_back_takes_the_real_rows(device):
    """``start_packed``: a ``[2 B]`` device buffer (B tokens then B log-probs, as the sampling decode
    graph writes it) reads back as the first ``n`` tokens and log-probs."""
    d2h = DeviceToHost(torch.device(device))
    packed = torch.tensor([5, 7, 9, 11, -0.5, -1.5, -2.5, -3.5], dtype=torch.float64, device=device)
    assert d2h.read(d2h.start_packed(packed, 3)) == ([5, 7, 9], [-0.5, -1.5, -2.5])
    assert d2h.read(d2h.start(packed[:2].long(), packed[4:6].float())) == ([5, 7], [-0.5, -1.5])
