"""Collectives Gloo cannot run on a group's device, run on host copies of its tensors.

The shared-GPU test mode (``DISTTRAIN_SHARED_GPU=1``,
:data:`~disttrain.names.SHARED_GPU_ENV`) puts every rank of a job on one GPU, so that
every strategy's CUDA code runs with a single GPU. NCCL refuses two ranks on one device,
so the groups are Gloo, and their :class:`~.collectives.Communicator` still reports the
CUDA device, as an NCCL group's would: strategies create and move CUDA tensors exactly
as under NCCL. Gloo takes CUDA tensors for all-reduce and broadcast only (it copies them
through pinned host memory itself, its work's ``wait()`` making the current stream wait
for the copy back); every other op (point-to-point, all-gather, reduce-scatter,
all-to-all) the Communicator stages through a :class:`HostStage`:

1. the tensors the op reads are copied device -> pinned host on the current stream, and
   the host waits for that stream: the copies hold what every kernel queued before the
   call wrote;
2. Gloo runs the op on the host buffers (what it writes goes to fresh pinned buffers);
3. once the op has completed (before a blocking call returns; in the returned work's
   ``wait()`` for an async one), the host buffers it wrote are copied host -> device on
   the current stream, so kernels queued after ``wait()`` see the result, as after
   NCCL's ``wait()``. The caching host allocator keeps a pinned buffer until its copy
   has run, so the buffers can be dropped at once.

It is a test mode, not a way to train: every staged op synchronises the host with the
GPU and crosses host memory twice (docs/testing.md).

``DISTTRAIN_HOST_STAGING=1`` (:data:`HOST_STAGING_ENV`) runs the same path on the CPU, a
debug switch for tests without a GPU: a Gloo group's CPU tensors are staged through
separate host buffers, the ones an op writes filled first with a poison byte pattern, so
a result copied back before the op completed, or from the wrong buffer, fails a test.
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
    host buffer back into its tensor (nothing when inactive; only the first call)."""

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
