"""Catching host reads inside a training step, on the CPU.

On a GPU, reading a device tensor on the host (``.item()``, ``.tolist()``, ``bool()``,
``float()``, ``.cpu()``, ...) makes the host wait until the device has finished every
queued kernel, so the GPU then idles while the host prepares the next work. On the CPU
such a read costs nothing and goes unnoticed; :class:`HostReads` (a torch function mode)
records every one that happens while it is recording, with the place in disttrain's
code that made it, so a test on the CPU can demand that a steady-state step makes none.

It is stricter than a GPU: every tensor counts, host-born ones included, except where
the work is the host's by design: the sample order (a permutation the sampler keeps on
the host) and loading a micro-batch (built on the host, then moved to the device).
:func:`watch_steps` records inside :func:`disttrain.train.step.train_step` from the
run's second step on: the first step may read (the tensor-parallel first-step proof),
and what the loop does between steps (reading the previous step's figures, which
arrive without blocking) is outside.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# what makes the host wait for a device tensor's value
READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
    torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__complex__,
    torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
    torch.equal, torch.allclose, torch.Tensor.allclose, torch.Tensor.equal,
})


class HostReads(TorchFunctionMode):
    """Records host reads (:data:`READS`) while ``recording``: ``reads`` holds, for
    each, the function's name and the innermost disttrain frame that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if self.recording and func in READS:
            self.reads.append(f"{getattr(func, '__name__', func)} at {_disttrain_frame()}")
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        previous, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = previous


def _disttrain_frame() -> str:
    """``file:line`` of the innermost frame in disttrain's own code (or any frame)."""
    frame = sys._getframe(2)
    outer = frame
    while frame is not None:
        name = frame.f_code.co_filename
        if "/disttrain/" in name and not name.endswith("host_reads.py"):
            return f"{'/'.join(name.split('/')[-3:])}:{frame.f_lineno}"
        frame = frame.f_back
    return f"{outer.f_code.co_filename}:{outer.f_lineno}"


@contextlib.contextmanager
def watch_steps(recorder: HostReads, first_step: int = 1) -> Iterator[None]:
    """Record inside every ``train_step`` of 0-based step >= ``first_step`` (loading
    paused); the functions are put back afterwards."""
    from disttrain.data.sampler import GlobalOrderSampler
    from disttrain.train import loading, step

    inner_step = step.train_step
    host_side = [(GlobalOrderSampler, "indices"), (loading.StepLoader, "load")]
    originals = [getattr(owner, name) for owner, name in host_side]

    def recorded_step(run: Any, index: int) -> Any:
        recorder.recording = index >= first_step
        try:
            return inner_step(run, index)
        finally:
            recorder.recording = False

    def paused(inner: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with recorder.paused():
                return inner(*args, **kwargs)
        return call

    step.train_step = recorded_step
    for (owner, name), inner in zip(host_side, originals, strict=True):
        setattr(owner, name, paused(inner))
    try:
        with recorder:
            yield
    finally:
        step.train_step = inner_step
        for (owner, name), inner in zip(host_side, originals, strict=True):
            setattr(owner, name, inner)
