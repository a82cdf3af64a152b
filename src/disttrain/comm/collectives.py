"""The single place that issues collectives.

A :class:`Communicator` wraps one process group. Every call is recorded in the rank's
:class:`CollectiveLedger` (sequence number, op, group, shape, call site) and its payload
bytes are counted, so diagnostics and byte accounting see all traffic.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


@dataclass(frozen=True)
class CollectiveRecord:
    seq: int
    op: str
    group: str
    shape: tuple[int, ...]
    dtype: str
    site: str


@dataclass
class CollectiveLedger:
    """The last ``capacity`` collectives this rank issued, and running totals."""

    capacity: int = 64
    records: deque = field(default_factory=deque)
    seq: int = 0
    payload_bytes: int = 0

    def record(self, op: str, group: str, tensor: torch.Tensor | None, site: str) -> None:
        self.seq += 1
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else ""
        if tensor is not None:
            self.payload_bytes += tensor.numel() * tensor.element_size()
        self.records.append(CollectiveRecord(self.seq, op, group, shape, dtype, site))
        if len(self.records) > self.capacity:
            self.records.popleft()

    def last(self) -> CollectiveRecord | None:
        return self.records[-1] if self.records else None


def _call_site(depth: int = 3) -> str:
    """``file.py:line`` of the caller outside this module (cheap: no stack walk)."""
    frame = sys._getframe(depth)
    return f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}"


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

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False) -> dist.Work | None:
        self.ledger.record("all_reduce", self.name, tensor, _call_site())
        if self.size == 1:
            return _DONE if async_op else None
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0,
                  async_op: bool = False) -> dist.Work | None:
        self.ledger.record("broadcast", self.name, tensor, _call_site())
        if self.size == 1:
            return _DONE if async_op else None
        global_src = dist.get_global_rank(self.group, src)
        return dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Send a small picklable object from ``src`` (used for run metadata only)."""
        self.ledger.record("broadcast_object", self.name, None, _call_site())
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src),
                                   group=self.group)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        self.ledger.record("all_gather_object", self.name, None, _call_site())
        if self.size == 1:
            return [obj]
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self.ledger.record("barrier", self.name, None, _call_site())
        if self.size > 1:
            dist.barrier(group=self.group)


class _Done:
    """A completed work handle, for groups of one rank."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _Done()
