"""Gradient buckets: flat buffers that parameters' gradients live in, reduced as a unit.

Each parameter's ``.grad`` is a view into its bucket's flat buffer, so autograd
accumulates straight into the buffer and no copy is made before or after the
reduction. Buckets are launched strictly in index order, on every rank alike: a rank
never issues bucket ``i+1`` before bucket ``i``, so the sequence of collectives is the
same on all ranks whatever order gradients become ready in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .codecs import GradientCodec
from .collectives import Communicator, TrackedWork
from .spans import SpanRecorder, now_us


class Reduction(Protocol):
    """A bucket's reduction in flight: a plain all-reduce's :class:`TrackedWork` or a
    codec's :class:`~disttrain.comm.codecs.PendingReduction`."""

    def wait(self) -> object: ...


@dataclass
class GradBucket:
    """Parameters ``params`` whose gradients occupy ``buffer[offsets[i]:...]``.

    buffer: [sum of numel], same dtype and device as the parameters.
    """

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    pending: int = 0
    handle: Reduction | None = None
    ready: set[int] = field(default_factory=set)
    views: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.views = [self.buffer[o:o + p.numel()].view(p.shape)
                      for p, o in zip(self.params, self.offsets, strict=True)]

    def grad_view(self, slot: int) -> torch.Tensor:
        """Parameter ``slot``'s gradient inside the flat buffer (built once)."""
        return self.views[slot]


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[GradBucket]:
    """Group ``params`` (in the order given: the expected order of readiness) into
    buckets of at most ``bucket_bytes`` (a parameter larger than that gets its own),
    never mixing dtypes or devices in one bucket."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        same_kind = groups and (groups[-1][0].dtype, groups[-1][0].device) == (p.dtype, p.device)
        if not groups or not same_kind or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return [_make_bucket(i, g) for i, g in enumerate(groups)]


def _make_bucket(index: int, params: list[nn.Parameter]) -> GradBucket:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    return GradBucket(index=index, params=params, offsets=offsets, buffer=buffer,
                      pending=len(params))


class BucketReducer:
    """Launches the all-reduce of each bucket once all its gradients are ready, in
    bucket order, asynchronously; :meth:`wait` completes them all.

    With a ``codec``, each bucket is reduced through it instead (keyed by the bucket
    index, segmented by its parameters' shapes); without one, the bucket's buffer (or its
    ``reduce_dtype`` copy) is all-reduced as is. Either way the result is the SUM over
    ranks. ``sent_bytes`` / ``wire_sent`` / ``dense_bytes`` count, since the last
    :meth:`reset`, the payload and the wire bytes sent that the ledger recorded for the
    buckets, and their size as fp32.
    """

    def __init__(self, buckets: list[GradBucket], comm: Communicator,
                 tracer: SpanRecorder | None = None,
                 reduce_dtype: torch.dtype = torch.float32,
                 codec: GradientCodec | None = None) -> None:
        self.buckets = buckets
        self.comm = comm
        self.tracer = tracer
        self.codec = codec
        self.sent_bytes = self.wire_sent = 0
        self.dense_bytes = 0
        self._next = 0
        self._started: dict[int, float] = {}
        if codec is not None and reduce_dtype != torch.float32:
            raise ValueError("a codec sets the wire format itself; leave reduce_dtype fp32")
        # a lower-precision copy per bucket that travels instead of the buffer
        self._wire = {b.index: torch.empty_like(b.buffer, dtype=reduce_dtype)
                      for b in buckets if b.buffer.dtype != reduce_dtype
                      and b.buffer.is_floating_point()}

    def reset(self) -> None:
        self._next = 0
        self.sent_bytes = self.dense_bytes = self.wire_sent = 0
        for b in self.buckets:
            b.pending, b.handle = len(b.params), None
            b.ready.clear()

    def mark_ready(self, bucket: GradBucket, slot: int) -> None:
        if slot in bucket.ready:
            raise RuntimeError(
                f"gradient of {tuple(bucket.params[slot].shape)} parameter produced twice "
                "in one backward; its bucket may already be reduced (call backward once "
                "per micro-batch, and wrap earlier ones in no_sync())")
        bucket.ready.add(slot)
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: GradBucket) -> None:
        ledger = self.comm.ledger
        start, sent, wire0 = now_us(), ledger.payload_bytes, ledger.wire_sent_bytes
        if self.codec is not None:
            bucket.handle = self.codec.start(bucket.buffer, self.comm, key=bucket.index,
                                             segments=[p.shape for p in bucket.params])
        else:
            wire = self._wire.get(bucket.index)
            if wire is not None:
                wire.copy_(bucket.buffer)
            bucket.handle = self.comm.all_reduce(bucket.buffer if wire is None else wire,
                                                 async_op=True)
        self.sent_bytes += ledger.payload_bytes - sent
        self.wire_sent += ledger.wire_sent_bytes - wire0
        self.dense_bytes += bucket.buffer.numel() * 4
        self._next += 1
        if self.tracer is not None and self.tracer.enabled:
            if self.codec is None:
                self._trace_completion(bucket, self.tracer, start)
            else:  # several collectives: traced from launch to the end of wait()
                self._started[bucket.index] = start

    def _trace_completion(self, bucket: GradBucket, tracer: SpanRecorder,
                          start: float) -> None:
        handle = bucket.handle  # a plain all-reduce's TrackedWork (no codec)
        future = handle.get_future() if isinstance(handle, TrackedWork) else None
        name = f"all_reduce bucket {bucket.index}"
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        if future is None:
            tracer.complete(name, start, now_us(), "comm", bytes=nbytes)
        else:  # the callback runs when the reduction completes, on the backend's thread
            future.then(lambda _: tracer.complete(name, start, now_us(), "comm",
                                                  bytes=nbytes))

    def wait(self, scale: float | torch.Tensor = 1.0) -> None:
        """Launch buckets whose parameters got no gradient (unused in this step), then
        wait for each reduction in turn and scale its bucket while later ones are still
        in flight."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for b in self.buckets:
            ledger = self.comm.ledger  # a codec's later rounds are sent here
            sent, wire0 = ledger.payload_bytes, ledger.wire_sent_bytes
            if b.handle is None:  # never: every bucket was launched just above
                raise RuntimeError(f"bucket {b.index} was not launched")
            b.handle.wait()
            self.sent_bytes += ledger.payload_bytes - sent
            self.wire_sent += ledger.wire_sent_bytes - wire0
            started = self._started.pop(b.index, None)
            if started is not None and self.tracer is not None and self.codec is not None:
                self.tracer.complete(f"{self.codec.name} bucket {b.index}",
                                     started, now_us(), "comm")
            wire = self._wire.get(b.index)
            if wire is not None:
                b.buffer.copy_(wire)
            if not (isinstance(scale, float) and scale == 1.0):
                b.buffer.mul_(scale)
