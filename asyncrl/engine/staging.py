"""Host<->device transfers of one engine step without blocking the host.

``HostToDevice.put(arrays)`` packs a step's host arrays (numpy, any dtypes) into one
pinned buffer and issues ONE asynchronous copy into a device byte buffer; it returns typed
device views. ``DeviceToHost`` copies a step's sampled tokens and log-probs into a pinned
buffer asynchronously and records an event; ``read`` waits for that event only.

Pinned buffers are double-buffered: slot ``i`` is rewritten two steps after its last use,
and before rewriting it the host waits on the event recorded after that use (a no-op in
the engine's loop, which has read step t by the time it launches step t+2). The device
buffer is single: step t+1's copy is queued on the same stream after step t's kernels, so
it never overwrites inputs a running step still reads.

On CPU there is nothing to overlap: ``put`` returns the arrays as tensors and ``read``
converts directly.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

_ALIGN = 16  # byte offset alignment of each array in the packed buffer (int64 views need 8)
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
           np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


class HostToDevice:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pinned: list[Optional[torch.Tensor]] = [None, None]
        self.events: list[Optional[torch.cuda.Event]] = [None, None]
        self.dev: Optional[torch.Tensor] = None
        self.typed: dict[np.dtype, torch.Tensor] = {}  # ``dev`` viewed as each dtype (made once per buffer)
        self.slot = 0

    def put(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors equal to ``arrays`` (valid for kernels queued after this call)."""
        if not self.cuda:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offs, total = [], 0
        for a in arrays:
            offs.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        slot, self.slot = self.slot, self.slot ^ 1
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # the copy that last read this slot is done
        if self.pinned[slot] is None or self.pinned[slot].numel() < total:
            self.pinned[slot] = torch.empty(max(total, 1 << 16), dtype=torch.uint8, pin_memory=True)
        if self.dev is None or self.dev.numel() < total:
            self.dev = torch.empty(self.pinned[slot].numel(), dtype=torch.uint8, device=self.device)
            self.typed = {}
        host = self.pinned[slot].numpy()
        for a, o in zip(arrays, offs):
            host[o:o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self.dev[:total].copy_(self.pinned[slot][:total], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.events[slot] = event
        return typed_views(self.dev, self.typed, arrays, offs)


def typed_views(buf: torch.Tensor, typed: dict, arrays: list[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
    """Views of the byte buffer ``buf`` holding ``arrays`` at byte ``offsets`` (multiples of
    ``_ALIGN``), each with its array's dtype and shape. ``typed`` caches ``buf`` viewed as each
    dtype, so an array costs one slice (and a reshape if not 1-D): the device side of a step's
    ~10 arrays took three view ops each."""
    out = []
    for a, o in zip(arrays, offsets):
        flat = typed.get(a.dtype)
        if flat is None:
            flat = typed[a.dtype] = buf.view(_DTYPES[a.dtype])
        i = o // a.itemsize
        v = flat[i:i + a.size]
        out.append(v if a.ndim == 1 else v.view(a.shape))
    return out


class DeviceToHost:
    """Sampled ``tokens [B]`` int64 and ``logprobs [B]`` fp32 -> host lists, one step late."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pinned: list[Optional[torch.Tensor]] = [None, None]
        self.slot = 0

    def start(self, tokens: torch.Tensor, logprobs: torch.Tensor):
        """Queue the copy; returns a handle for ``read``. Token ids < 2^53 are exact in fp64."""
        n = tokens.shape[0]
        return self.start_packed(torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]).view(-1), n)

    def start_packed(self, packed: torch.Tensor, n: int):
        """Queue the copy of ``packed`` ``[2 B]`` fp64 (B tokens, then their B log-probs, packed on the
        device: ``start``, or the decode graph that samples) of which the first ``n`` rows are read."""
        rows = packed.numel() // 2
        if not self.cuda:  # a snapshot: ``packed`` may be a graph's buffer that the next step rewrites
            return packed.view(2, rows)[:, :n].clone(), None
        slot, self.slot = self.slot, self.slot ^ 1
        if self.pinned[slot] is None or self.pinned[slot].numel() < 2 * rows:
            self.pinned[slot] = torch.empty(2 * max(rows, 512), dtype=torch.float64, pin_memory=True)
        # a CONTIGUOUS pinned target: copying into a strided view goes through a pageable
        # temporary and blocks the host until the step is done (measured: no overlap)
        out = self.pinned[slot][:2 * rows]
        out.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return out.view(2, rows)[:, :n], event

    @staticmethod
    def read(handle) -> tuple[list[int], list[float]]:
        out, event = handle
        if event is not None:
            event.synchronize()
        rows = out.tolist()
        return [int(t) for t in rows[0]], rows[1]


class StaticInputs:
    """Fixed-address device inputs of captured CUDA graphs, filled by ONE host->device copy.

    ``layouts[bs] = {name: (shape, numpy dtype)}``: the arrays a bucket's graph reads, packed at
    fixed offsets of one device byte buffer (each bucket its own packing; the buckets share the
    buffer, as only one graph replays at a time, in stream order). ``views(bs)`` gives the typed
    device views a graph is captured on; ``put(bs, arrays)`` packs the host arrays into a pinned
    buffer (double-buffered as ``HostToDevice``'s) and issues one asynchronous copy, so a round
    costs one copy however many inputs its graph has. On CPU the views are plain tensors written
    in place."""

    def __init__(self, layouts: dict[int, dict[str, tuple[tuple, np.dtype]]], device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.layouts: dict[int, dict[str, tuple[int, tuple, np.dtype]]] = {}
        total = 0
        for bs, layout in layouts.items():
            off, packed = 0, {}
            for name, (shape, dtype) in layout.items():
                packed[name] = (off, tuple(shape), np.dtype(dtype))
                off += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
            self.layouts[bs] = packed
            total = max(total, off)
        self.dev = torch.zeros(max(total, _ALIGN), dtype=torch.uint8, device=device)
        self.pinned = [torch.empty(self.dev.numel(), dtype=torch.uint8, pin_memory=True) for _ in range(2)] \
            if self.cuda else []
        self.events: list[Optional[torch.cuda.Event]] = [None, None]
        self.slot = 0
        self.padding: dict[int, dict[str, np.ndarray]] = {}  # per bucket, set by ``padded``

    @classmethod
    def padded(cls, padding: dict[int, dict[str, np.ndarray]], device: torch.device) -> "StaticInputs":
        """The layouts of ``padding`` (per bucket, arrays of every padding row), kept so that
        ``put_padding(bs)`` can stage them: the inputs a bucket's graph warm-up reads."""
        staged = cls({bs: {n: (a.shape, a.dtype) for n, a in arrays.items()} for bs, arrays in padding.items()},
                     device)
        staged.padding = padding
        return staged

    def put_padding(self, bs: int) -> None:
        self.put(bs, self.padding[bs])

    def views(self, bs: int) -> dict[str, torch.Tensor]:
        return {name: self._view(self.dev, o, shape, dt) for name, (o, shape, dt) in self.layouts[bs].items()}

    @staticmethod
    def _view(buf: torch.Tensor, offset: int, shape: tuple, dtype: np.dtype) -> torch.Tensor:
        n = int(np.prod(shape)) * dtype.itemsize
        return buf[offset:offset + n].view(_DTYPES[dtype]).view(shape)

    def put(self, bs: int, arrays: dict[str, np.ndarray]) -> None:
        """Write ``arrays`` (every name of bucket ``bs``'s layout, cast to its dtype) into its views."""
        layout = self.layouts[bs]
        if set(arrays) != set(layout):
            raise KeyError(f"StaticInputs.put: bucket {bs} takes {sorted(layout)}, got {sorted(arrays)}")
        if not self.cuda:
            for name, (o, shape, dt) in layout.items():
                self._view(self.dev, o, shape, dt).copy_(torch.from_numpy(np.asarray(arrays[name], dtype=dt)))
            return
        slot, self.slot = self.slot, self.slot ^ 1
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # the copy that last read this slot is done
        host = self.pinned[slot].numpy()
        end = 0
        for name, (o, shape, dt) in layout.items():
            a = np.ascontiguousarray(arrays[name], dtype=dt).reshape(shape)
            host[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
            end = max(end, o + a.nbytes)
        self.dev[:end].copy_(self.pinned[slot][:end], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.events[slot] = event
