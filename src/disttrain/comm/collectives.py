"""The single place that issues collectives.

A :class:`Communicator` wraps one process group. Every call is recorded in the rank's
:class:`CollectiveLedger` (sequence number, op, group, shape, call site) and its payload
bytes are counted, so diagnostics and byte accounting see all traffic.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
# the single-tensor collectives' names changed in recent torch releases
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class CollectiveRecord:
    seq: int
    op: str
    group: str
    shape: tuple[int, ...]
    dtype: str
    site: str


    def describe(self) -> str:
        return f"{self.op} #{self.seq} ({self.site})"


@dataclass
class CollectiveLedger:
    """The last ``capacity`` collectives this rank issued, running totals, and the one
    this rank is blocked on right now (read by the hang watchdog's thread)."""

    capacity: int = 64
    records: deque = field(default_factory=deque)
    seq: int = 0
    payload_bytes: int = 0
    waiting: CollectiveRecord | None = None
    waiting_since: float = 0.0
    wait_seconds: float = 0.0  # total time blocked in collectives (exposed communication)

    def record(self, op: str, group: str, tensor: torch.Tensor | None,
               site: str) -> CollectiveRecord:
        self.seq += 1
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else ""
        if tensor is not None:
            self.payload_bytes += tensor.numel() * tensor.element_size()
        rec = CollectiveRecord(self.seq, op, group, shape, dtype, site)
        self.records.append(rec)
        if len(self.records) > self.capacity:
            self.records.popleft()
        return rec

    def last(self) -> CollectiveRecord | None:
        return self.records[-1] if self.records else None

    @contextlib.contextmanager
    def blocked_on(self, record: CollectiveRecord) -> Iterator[None]:
        """Mark this rank as waiting for ``record`` to complete."""
        self.waiting, self.waiting_since = record, time.monotonic()
        try:
            yield
        finally:
            self.wait_seconds += time.monotonic() - self.waiting_since
            self.waiting = None


class TrackedWork:
    """An async collective's handle; waiting on it is recorded in the ledger."""

    def __init__(self, work: dist.Work | None, ledger: CollectiveLedger,
                 record: CollectiveRecord) -> None:
        self.work, self.ledger, self.record = work, ledger, record

    def wait(self) -> bool:
        if self.work is None:
            return True
        with self.ledger.blocked_on(self.record):
            return self.work.wait()

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def get_future(self) -> torch.futures.Future | None:
        return None if self.work is None else self.work.get_future()


def _call_site(depth: int) -> str:
    """``package/file.py:line`` of the frame ``depth`` levels up (no stack walk)."""
    frame = sys._getframe(depth)
    path = "/".join(frame.f_code.co_filename.split("/")[-2:])
    return f"{path}:{frame.f_lineno}"


class Communicator:
    """Collectives over one process group, recorded in a ledger.

    Ranks passed to ``broadcast`` are ranks *within the group*.
    """

    def __init__(self, group: dist.ProcessGroup | None, ledger: CollectiveLedger,
                 name: str = "world") -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.ledger = ledger
        self.name = name
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def __deepcopy__(self, memo: dict) -> Communicator:
        """A handle on a shared process group: copies of a module share it."""
        return self

    def _run(self, op: str, tensor: torch.Tensor | None, call: Callable[[bool], Any],
             async_op: bool) -> Any:
        """Record ``op``, then issue it (``call(async_op)``); a blocking call is marked
        as waiting in the ledger, an async one returns a :class:`TrackedWork`."""
        rec = self.ledger.record(op, self.name, tensor, _call_site(3))
        if async_op:
            return TrackedWork(call(True) if self.size > 1 else None, self.ledger, rec)
        if self.size == 1:
            return None
        with self.ledger.blocked_on(rec):
            return call(False)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False) -> TrackedWork | None:
        return self._run("all_reduce", tensor, lambda a: dist.all_reduce(
            tensor, op=op, group=self.group, async_op=a), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0,
                  async_op: bool = False) -> TrackedWork | None:
        src = dist.get_global_rank(self.group, src) if self.size > 1 else src
        return self._run("broadcast", tensor, lambda a: dist.broadcast(
            tensor, src=src, group=self.group, async_op=a), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: bool = False) -> TrackedWork | None:
        """Sum ``input`` [size * n] over ranks; rank r receives block r in ``output`` [n]."""
        if self.size == 1:
            output.copy_(input)
        return self._run("reduce_scatter", input, lambda a: _REDUCE_SCATTER(
            output, input, group=self.group, async_op=a), async_op)

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor,
                        async_op: bool = False) -> TrackedWork | None:
        """Concatenate every rank's ``input`` [n] into ``output`` [size * n]."""
        if self.size == 1:
            output.copy_(input)
        return self._run("all_gather", input, lambda a: _ALL_GATHER(
            output, input, group=self.group, async_op=a), async_op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Each rank's ``tensor`` (same shape everywhere), in group-rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        if self.size == 1:
            out[0].copy_(tensor)
        self._run("all_gather", tensor, lambda a: dist.all_gather(
            out, tensor, group=self.group), False)
        return out

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Send a small picklable object from ``src`` (used for run metadata only)."""
        box = [obj]
        src = dist.get_global_rank(self.group, src) if self.size > 1 else src
        self._run("broadcast_object", None, lambda a: dist.broadcast_object_list(
            box, src=src, group=self.group), False)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        out: list[object] = [obj] if self.size == 1 else [None] * self.size
        self._run("all_gather_object", None, lambda a: dist.all_gather_object(
            out, obj, group=self.group), False)
        return out

    def barrier(self) -> None:
        self._run("barrier", None, lambda a: dist.barrier(group=self.group), False)

    # Point-to-point (pipeline parallelism). Peers are ranks within the group; a
    # message is matched by (sender, tag), so distinct tags never cross.

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> TrackedWork:
        """Start sending ``tensor`` (contiguous, kept alive by the caller until the
        returned work completes) to group rank ``dst``."""
        return self._run("send", tensor, lambda a: dist.isend(
            tensor, group=self.group, tag=tag, group_dst=dst), True)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> TrackedWork:
        """Start receiving into ``tensor`` (preallocated, the sender's shape and dtype)
        from group rank ``src``."""
        return self._run("recv", tensor, lambda a: dist.irecv(
            tensor, group=self.group, tag=tag, group_src=src), True)

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        """Receive into ``tensor`` from whichever group rank's message comes first
        (blocking; the parameter servers' inbox); returns that sender's group rank."""
        work = self._run("recv_any", tensor, lambda a: dist.irecv(
            tensor, group=self.group, tag=tag), True)
        work.wait()
        return work.work._source_rank()
