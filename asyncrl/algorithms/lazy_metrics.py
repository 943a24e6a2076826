"""Scalar metrics that stay on the device until someone reads them.

The loss functions return a few scalar statistics per micro-batch. Reading them as Python
floats is a host<->device sync; inside the trainer's update that sync sits between a
micro-batch's forward and its backward, where the GPU then idles while the host waits. A
:class:`LazyMetrics` holds the names and one stacked tensor: a caller that reads it as a
mapping pays one sync (on first read, for all the values together), and the trainer takes the
device tensors (:meth:`stacked`, :meth:`tensors`) and converts every micro-batch's metrics at
once, per optimizer step.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator, Optional

import torch


class LazyMetrics(Mapping):
    """``Mapping[str, float]`` over ``keys`` and ``values`` ([len(keys)], detached).

    Invariant: ``self[k] == float(values[keys.index(k)])``; the floats are computed once, on
    the first read, with one ``tolist`` (one sync)."""

    def __init__(self, keys: tuple[str, ...], values: torch.Tensor):
        if values.shape != (len(keys),):
            raise ValueError(f"{len(keys)} metric names for values of shape {tuple(values.shape)}")
        self._keys, self._values = tuple(keys), values.detach()
        self._floats: Optional[dict[str, float]] = None

    def stacked(self) -> torch.Tensor:
        """The values, [len(keys)], on their device (no sync)."""
        return self._values

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> 0-dim device tensor (no sync)."""
        return dict(zip(self._keys, self._values.unbind()))

    def _read(self) -> dict[str, float]:
        if self._floats is None:
            self._floats = dict(zip(self._keys, self._values.tolist()))
        return self._floats

    def __getitem__(self, key: str) -> float:
        return self._read()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keys  # no sync

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)  # the names need no sync

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"LazyMetrics({self._read()!r})"
