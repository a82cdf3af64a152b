"""Counting the activation bytes a forward keeps for backward.

:class:`SavedActivationMeter` is a ``torch.autograd.graph.saved_tensors_hooks``: inside
``with meter:`` every tensor autograd saves for backward is counted once per storage
(several saves of one storage count once), parameters excluded, until the graph that
saved it is freed by backward. ``peak_bytes`` is the most held at once. One meter may
be entered many times (a pipeline's micro-batches): what each entry saved stays
counted until its backward.

A parameter is recognised by its storage or, since ZeRO-3 gathers parameters into
storage allocated after the meter was made, as a ``Parameter`` or a view of one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class _Saved:
    """What the graph keeps instead of the tensor; releases its count when freed."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedActivationMeter, key: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedActivationMeter(torch.autograd.graph.saved_tensors_hooks):
    """Live and peak bytes of tensors saved for backward (parameters excluded)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {p.untyped_storage().data_ptr() for p in params}
        self._live: dict[int, list[int]] = {}  # storage ptr -> [saves, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0 or _is_parameter(tensor):
            return tensor
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        # detached: a saved output would otherwise hold its own grad_fn, a cycle through
        # the graph that Python's collector cannot see, and a graph dropped without a
        # backward that frees it (a zero-bubble pipeline's, after its W) would stay
        return _Saved(tensor.detach(), self, key)

    @staticmethod
    def _unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._live[key]


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()``)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)
