"""Collectives Gloo cannot run on a group's device, run on host copies of its tensors.

The shared-GPU test mode (:data:`~disttrain.names.SHARED_GPU_ENV`) puts every rank on
one GPU over Gloo groups that report the CUDA device, so strategies run their CUDA code
as under NCCL; Gloo takes CUDA tensors for all-reduce and broadcast only, so the
Communicator stages every other op through a :class:`HostStage`.
``DISTTRAIN_HOST_STAGING=1`` (:data:`HOST_STAGING_ENV`) runs the same path on CPU
tensors, with poisoned buffers, to test it without a GPU. Both: ``docs/testing.md``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..names import SHARED_GPU_ENV

HOST_STAGING_ENV = "DISTTRAIN_HOST_STAGING"
# what the debug switch fills a receiving host buffer with: 0xA5A5A5A5 is a NaN-free
# float32 of -2.9e-16, an int32 of -1.5e9; no test's value
_POISON = 0xA5


def _switch(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def shared_gpu() -> bool:
    """Whether this process runs in the shared-GPU test mode (``DISTTRAIN_SHARED_GPU=1``)."""
    return _switch(SHARED_GPU_ENV)


def host_staging_forced() -> bool:
    """Whether Gloo groups on the CPU stage their ops too (``DISTTRAIN_HOST_STAGING=1``)."""
    return _switch(HOST_STAGING_ENV)


class HostStage:
    """One op's tensors as Gloo is handed them: ``reads`` (what the op reads) and
    ``writes`` (what it writes), host copies when ``active``, else the tensors
    themselves. :meth:`finish`, called once the op has completed, copies each written
    host buffer back into its tensor (nothing when inactive; only the first call).

    The reads are copied device -> pinned host on the current stream and the host waits
    for it, so they hold what every kernel queued before the call wrote; the writes go
    to fresh pinned buffers, copied back on the current stream, so kernels queued after
    ``wait()`` see the result, as after NCCL's. The caching host allocator keeps a
    pinned buffer until its copy has run, so the buffers can be dropped at once."""

    def __init__(self, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor],
                 active: bool) -> None:
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, host)
        self._non_blocking = False
        if not active:
            self.reads, self.writes = list(reads), list(writes)
            return
        on_gpu = any(t.is_cuda for t in (*reads, *writes))
        self.reads = [_host_like(t, on_gpu).copy_(t, non_blocking=on_gpu) for t in reads]
        self.writes = [_host_like(t, on_gpu) for t in writes]
        if on_gpu and reads:  # the device -> host copies are queued: wait for them
            torch.cuda.current_stream(reads[0].device).synchronize()
        if not on_gpu:  # the debug switch: a premature copy back reads poison
            for host in self.writes:
                host.reshape(-1).view(torch.uint8).fill_(_POISON)
        self._non_blocking = on_gpu
        self._pending = list(zip(writes, self.writes, strict=True))

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for target, host in pending:
            target.copy_(host, non_blocking=self._non_blocking)


def _host_like(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """An uninitialised contiguous host buffer of ``t``'s shape and dtype (page-locked
    for a CUDA tensor, so copies to and from it can be queued on a stream)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
