"""The single place that issues collectives.

A :class:`Communicator` wraps one process group and records every call in the rank's
:class:`CollectiveLedger` (sequence number, op, group, shape, call site, payload and wire
bytes: :func:`wire_bytes`), so hang diagnostics and byte counts see all traffic. It
keeps NCCL's requirements on any backend (one device per group, contiguous tensors,
point-to-point messages matched in posting order), so what passes on Gloo is what NCCL
accepts; how they are checked: ``docs/testing.md``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

import torch
import torch.distributed as dist

from .staging import HostStage, host_staging_forced, shared_gpu

ReduceOp = dist.ReduceOp
# ReduceOp.SUM and the others are RedOpType members in torch's stubs, not ReduceOps
AnyReduceOp = ReduceOp | ReduceOp.RedOpType
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


def wire_bytes(op: str, payload: int, size: int, root: bool = False) -> tuple[int, int]:
    """(sent, received) bytes of one rank in ``op`` over ``size`` ranks, where
    ``payload`` is the tensor the rank passes in, as the bandwidth-optimal algorithms
    NCCL and Gloo use move them: ring all-reduce 2 (N-1)/N P each way (a reduce-scatter
    then an all-gather); reduce-scatter of a [N x n] input (N-1)/N P, and all-to-all of one the same
    (every block but its own leaves the rank); all-gather of an
    [n] block (N-1) P (every other rank's block passes through); broadcast P sent by the
    root and P received by every other rank (the least any algorithm moves; a ring also
    forwards); a point-to-point message P. Object collectives and barriers: 0 (their
    pickled size is not known here)."""
    if size <= 1:
        return 0, 0
    if op == "all_reduce":
        each = 2 * (size - 1) * payload // size
        return each, each
    if op == "reduce_scatter":
        each = (size - 1) * payload // size
        return each, each
    if op == "all_gather":
        return (size - 1) * payload, (size - 1) * payload
    if op == "all_to_all":
        each = (size - 1) * payload // size
        return each, each
    if op == "broadcast":
        return (payload, 0) if root else (0, payload)
    if op == "send":
        return payload, 0
    if op in ("recv", "recv_any"):
        return 0, payload
    return 0, 0


@dataclass
class CollectiveLedger:
    """The last ``capacity`` collectives this rank issued, running totals, and the one
    this rank is blocked on right now (read by the hang watchdog's thread)."""

    capacity: int = 64
    records: deque = field(default_factory=deque)
    seq: int = 0
    payload_bytes: int = 0
    wire_sent_bytes: int = 0   # what this rank put on the wire (wire_bytes)
    wire_recv_bytes: int = 0
    waiting: CollectiveRecord | None = None
    waiting_since: float = 0.0
    wait_seconds: float = 0.0  # total time blocked in collectives (exposed communication)
    # the communicators that record here, released together once their groups are
    # destroyed (:func:`release_groups`)
    members: list[Communicator] = field(default_factory=list)

    def record(self, op: str, group: str, tensor: torch.Tensor | None,
               site: str, size: int = 1, root: bool = False) -> CollectiveRecord:
        """Record ``op`` on a group of ``size`` ranks (``root``: this rank is a
        broadcast's source)."""
        self.seq += 1
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else ""
        if tensor is not None:
            payload = tensor.numel() * tensor.element_size()
            self.payload_bytes += payload
            sent, received = wire_bytes(op, payload, size, root)
            self.wire_sent_bytes += sent
            self.wire_recv_bytes += received
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


NCCL_RULES_ENV = "DISTTRAIN_NCCL_RULES"
_HEADER_TAG = 0  # the one tag every message uses under NCCL's rules


class MessageOrderError(RuntimeError):
    """A point-to-point message was consumed out of the order it was posted in (NCCL
    matches the messages between two ranks by posting order only, not by tag)."""


class TrackedWork:
    """An async collective's handle; waiting on it is recorded in the ledger.

    ``extra``: works that complete before the main one (a message's header); ``check``
    runs once they have (the header's check); ``finish`` once the main work has (a
    staged op's copy back into its tensors, :mod:`.staging`); ``keep``: objects that
    must outlive the transfer (a header, host copies). Of a staged op, ``is_completed``
    and ``get_future`` tell that the transfer is done; its result reaches the caller's
    tensors in ``wait()``.
    """

    def __init__(self, work: dist.Work | None, ledger: CollectiveLedger,
                 record: CollectiveRecord,
                 extra: list[dist.Work | None] | None = None,
                 check: Callable[[], None] | None = None,
                 finish: Callable[[], None] | None = None,
                 keep: tuple[object, ...] = ()) -> None:
        self.work, self.ledger, self.record = work, ledger, record
        self.extra = [w for w in extra or [] if w is not None]
        self.check, self.finish = check, finish
        self.keep = keep

    def wait(self) -> bool:
        if self.work is None:
            return True
        with self.ledger.blocked_on(self.record):
            for work in self.extra:  # a message's header first, then its check
                work.wait()
            if self.check is not None:
                check, self.check = self.check, None
                check()
            done = self.work.wait()
            if self.finish is not None:
                finish, self.finish = self.finish, None
                finish()
            return done

    def is_completed(self) -> bool:
        return self.work is None or (self.work.is_completed()
                                     and all(w.is_completed() for w in self.extra))

    def get_future(self) -> torch.futures.Future | None:
        return None if self.work is None else self.work.get_future()


def _call_site(depth: int) -> str:
    """``package/file.py:line`` of the frame ``depth`` levels up (no stack walk)."""
    frame = sys._getframe(depth)
    path = "/".join(frame.f_code.co_filename.split("/")[-2:])
    return f"{path}:{frame.f_lineno}"


def nccl_rules_default() -> bool:
    """Whether NCCL's rules apply to every Communicator (``DISTTRAIN_NCCL_RULES=1``)."""
    return os.environ.get(NCCL_RULES_ENV, "") not in ("", "0")


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a process group's tensors live on: the current CUDA device for NCCL,
    and for Gloo in the shared-GPU test mode (:func:`.staging.shared_gpu`); the CPU
    otherwise (Gloo)."""
    if dist.is_initialized():
        backend = dist.get_backend(group)
        if backend == "nccl" or (backend == "gloo" and shared_gpu()):
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_Obj = TypeVar("_Obj")  # the picklable object every rank passes to all_gather_object


class Communicator:
    """Collectives over one process group, recorded in a ledger.

    Ranks passed to ``broadcast`` are ranks *within the group*. ``control``: a Gloo
    group on the CPU carrying control messages beside a device group (receive-from-any
    allowed under NCCL's rules). Buffers that travel are made with :meth:`empty` /
    :meth:`zeros` on ``device`` (the current CUDA device for NCCL and the shared-GPU
    test mode, else the CPU); every op refuses a tensor on another device, or a
    non-contiguous one, naming the op and the call site. ``nccl_rules`` (default: the
    environment's ``DISTTRAIN_NCCL_RULES``): no receive-from-any on a data group, and
    every message sent under one tag behind a header of the caller's tag and size, so
    the receiver checks it got the message it asked for (:class:`MessageOrderError`
    otherwise). ``staged``: the ops other than all-reduce and broadcast run on host
    copies (:mod:`.staging`): always on a Gloo data group on a CUDA device (the
    shared-GPU test mode); on the CPU, under the debug switch ``host_staging`` (default:
    the environment's ``DISTTRAIN_HOST_STAGING``).
    """

    def __init__(self, group: dist.ProcessGroup | None, ledger: CollectiveLedger,
                 name: str = "world", *, control: bool = False,
                 nccl_rules: bool | None = None, host_staging: bool | None = None
                 ) -> None:
        self.group: dist.ProcessGroup | None = (
            group if group is not None else dist.group.WORLD)
        self.ledger = ledger
        ledger.members.append(self)
        self.name = name
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        gloo = dist.get_backend(self.group) == "gloo"
        if control and not gloo:
            raise ValueError(f"a control communicator must be a Gloo (CPU) group; "
                             f"{name!r} is {dist.get_backend(self.group)}")
        self.device = torch.device("cpu") if control else group_device(self.group)
        self.control = control
        self.nccl_rules = nccl_rules_default() if nccl_rules is None else nccl_rules
        forced = host_staging_forced() if host_staging is None else host_staging
        self.staged = self.size > 1 and gloo and not control and (
            self.device.type == "cuda" or forced)
        # where Gloo is handed the tensors: the host for a staged group's ops
        self._carrier = torch.device("cpu") if self.staged else self.device

    def empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised buffer on this group's device (to receive into)."""
        return torch.empty(*shape, dtype=dtype, device=self.device)

    def zeros(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed buffer on this group's device."""
        return torch.zeros(*shape, dtype=dtype, device=self.device)

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        """Refuse a tensor this group cannot move: on another device, or not
        contiguous (NCCL moves contiguous device memory only)."""
        for t in tensors:
            if t.device != self.device:
                raise ValueError(f"{op} on the {self.name!r} group ({self.device}) was "
                                 f"given a tensor on {t.device} at {_call_site(3)}; "
                                 f"create it with the communicator's empty()/zeros() or "
                                 f"move it to {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"{op} on the {self.name!r} group was given a "
                                 f"non-contiguous tensor {tuple(t.shape)} at "
                                 f"{_call_site(3)}; pass .contiguous()")

    def _global_rank(self, group_rank: int) -> int:
        """``group_rank`` of this group as a global rank (itself on a group of one)."""
        if self.size == 1 or self.group is None:  # None: never, once dist is initialised
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def __deepcopy__(self, memo: dict) -> Communicator:
        """A handle on a shared process group: copies of a module share it."""
        return self

    def _stage(self, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> HostStage:
        """The tensors an op reads and writes as Gloo must be handed them: host copies
        on a staged group, else themselves."""
        return HostStage(reads, writes, self.staged)

    def _run(self, op: str, tensor: torch.Tensor | None, call: Callable[[bool], Any],
             async_op: bool, root: bool = False, *, stage: HostStage | None = None,
             extra: list[dist.Work | None] | None = None,
             check: Callable[[], None] | None = None,
             keep: tuple[object, ...] = ()) -> Any:
        """Record ``op``, then issue it (``call(async_op)``); a blocking call is marked
        as waiting in the ledger, an async one returns a :class:`TrackedWork` (with
        ``extra``, ``check`` and ``keep``). A ``stage``'s results are copied back once
        the op has completed."""
        rec = self.ledger.record(op, self.name, tensor, _call_site(3), self.size, root)
        finish = None if stage is None else stage.finish
        if async_op:
            return TrackedWork(call(True) if self.size > 1 else None, self.ledger, rec,
                               extra, check, finish, (*keep, stage))
        if self.size == 1:
            return None
        with self.ledger.blocked_on(rec):
            result = call(False)
            if finish is not None:
                finish()
            return result

    # Each op returns a TrackedWork when async, None when blocking (typed by overloads).
    @overload
    def all_reduce(self, tensor: torch.Tensor, op: AnyReduceOp = ..., *,
                   async_op: Literal[True]) -> TrackedWork: ...
    @overload
    def all_reduce(self, tensor: torch.Tensor, op: AnyReduceOp = ...,
                   async_op: Literal[False] = ...) -> None: ...
    @overload
    def all_reduce(self, tensor: torch.Tensor, op: AnyReduceOp = ...,
                   async_op: bool = ...) -> TrackedWork | None: ...

    def all_reduce(self, tensor: torch.Tensor, op: AnyReduceOp = ReduceOp.SUM,
                   async_op: bool = False) -> TrackedWork | None:
        self._check("all_reduce", tensor)
        return self._run("all_reduce", tensor, lambda a: dist.all_reduce(
            tensor, op=op, group=self.group, async_op=a), async_op)

    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = ..., *,
                  async_op: Literal[True]) -> TrackedWork: ...
    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = ...,
                  async_op: Literal[False] = ...) -> None: ...
    @overload
    def broadcast(self, tensor: torch.Tensor, src: int = ...,
                  async_op: bool = ...) -> TrackedWork | None: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0,
                  async_op: bool = False) -> TrackedWork | None:
        self._check("broadcast", tensor)
        root = src == self.rank
        src = self._global_rank(src)
        return self._run("broadcast", tensor, lambda a: dist.broadcast(
            tensor, src=src, group=self.group, async_op=a), async_op, root)

    @overload
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       async_op: Literal[True]) -> TrackedWork: ...
    @overload
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: Literal[False] = ...) -> None: ...
    @overload
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: bool = ...) -> TrackedWork | None: ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: bool = False) -> TrackedWork | None:
        """Sum ``input`` [size * n] over ranks; rank r receives block r in ``output`` [n]."""
        self._check("reduce_scatter", output, input)
        if self.size == 1:
            output.copy_(input)
        st = self._stage([input], [output])
        return self._run("reduce_scatter", input, lambda a: _REDUCE_SCATTER(
            st.writes[0], st.reads[0], group=self.group, async_op=a), async_op, stage=st)

    @overload
    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor, *,
                        async_op: Literal[True]) -> TrackedWork: ...
    @overload
    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor,
                        async_op: Literal[False] = ...) -> None: ...
    @overload
    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor,
                        async_op: bool = ...) -> TrackedWork | None: ...

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor,
                        async_op: bool = False) -> TrackedWork | None:
        """Concatenate every rank's ``input`` [n] into ``output`` [size * n]."""
        self._check("all_gather", output, input)
        if self.size == 1:
            output.copy_(input)
        st = self._stage([input], [output])
        return self._run("all_gather", input, lambda a: _ALL_GATHER(
            st.writes[0], st.reads[0], group=self.group, async_op=a), async_op, stage=st)

    @overload
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   async_op: Literal[True]) -> TrackedWork: ...
    @overload
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   async_op: Literal[False] = ...) -> None: ...
    @overload
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   async_op: bool = ...) -> TrackedWork | None: ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   async_op: bool = False) -> TrackedWork | None:
        """Block j of ``input`` [size * n] goes to rank j; ``output`` [size * n] holds
        block r of every rank, in group-rank order."""
        self._check("all_to_all", output, input)
        if self.size == 1:
            output.copy_(input)
        st = self._stage([input], [output])
        return self._run("all_to_all", input, lambda a: dist.all_to_all_single(
            st.writes[0], st.reads[0], group=self.group, async_op=a), async_op, stage=st)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Each rank's ``tensor`` (same shape everywhere), in group-rank order."""
        self._check("all_gather", tensor)
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        if self.size == 1:
            out[0].copy_(tensor)
        st = self._stage([tensor], out)
        self._run("all_gather", tensor, lambda a: dist.all_gather(
            st.writes, st.reads[0], group=self.group), False, stage=st)
        return out

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Send a small picklable object from ``src`` (used for run metadata only)."""
        box = [obj]
        src = self._global_rank(src)
        self._run("broadcast_object", None, lambda a: dist.broadcast_object_list(
            box, src=src, group=self.group), False)
        return box[0]

    def all_gather_object(self, obj: _Obj) -> list[_Obj]:
        out: list[Any] = [obj] if self.size == 1 else [None] * self.size
        self._run("all_gather_object", None, lambda a: dist.all_gather_object(
            out, obj, group=self.group), False)
        return out

    def barrier(self) -> None:
        self._run("barrier", None, lambda a: dist.barrier(group=self.group), False)

    # Point-to-point. Peers are ranks within the group. Without NCCL's rules a message
    # is matched by (sender, tag), so distinct tags never cross; with them, by posting
    # order between the two ranks only (the tag is checked, not used for matching).

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> TrackedWork:
        """Start sending ``tensor`` (contiguous, kept alive by the caller until the
        returned work completes) to group rank ``dst``."""
        self._check("send", tensor)
        st = self._stage([tensor], [])
        wire = st.reads[0]
        if not self.nccl_rules or self.control:
            return self._run("send", tensor, lambda a: dist.isend(
                wire, group=self.group, tag=tag, group_dst=dst), True, stage=st)
        header = torch.tensor([tag, tensor.numel()], dtype=torch.int64,
                              device=self._carrier)
        first = dist.isend(header, group=self.group, tag=_HEADER_TAG, group_dst=dst)
        return self._run("send", tensor, lambda a: dist.isend(
            wire, group=self.group, tag=_HEADER_TAG, group_dst=dst), True, stage=st,
            extra=[first], keep=(header,))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> TrackedWork:
        """Start receiving into ``tensor`` (preallocated, the sender's shape and dtype)
        from group rank ``src``."""
        self._check("recv", tensor)
        st = self._stage([], [tensor])
        wire = st.writes[0]
        if not self.nccl_rules or self.control:
            return self._run("recv", tensor, lambda a: dist.irecv(
                wire, group=self.group, tag=tag, group_src=src), True, stage=st)
        header = torch.empty(2, dtype=torch.int64, device=self._carrier)
        first = dist.irecv(header, group=self.group, tag=_HEADER_TAG, group_src=src)
        site = _call_site(2)

        def check() -> None:
            got_tag, numel = header.tolist()
            if got_tag != tag or numel != tensor.numel():
                raise MessageOrderError(
                    f"rank {self.rank} of {self.name!r} asked rank {src} for message "
                    f"tag {tag} ({tensor.numel()} elements) at {site} but the next one "
                    f"rank {src} posted is tag {got_tag} ({numel} elements): under NCCL "
                    "messages between two ranks match in posting order only; post "
                    "receives in the order the peer sends")

        return self._run("recv", tensor, lambda a: dist.irecv(
            wire, group=self.group, tag=_HEADER_TAG, group_src=src), True, stage=st,
            extra=[first], check=check, keep=(header,))

    def recv_any(self, tensor: torch.Tensor, tag: int = 0) -> int:
        """Receive into ``tensor`` from whichever group rank's message comes first
        (blocking); returns that sender's group rank. Only on a control group under
        NCCL's rules (NCCL has no receive-from-any)."""
        self._check("recv_any", tensor)
        if self.nccl_rules and not self.control:
            raise ValueError(f"recv_any on the {self.name!r} group at {_call_site(2)}: "
                             "NCCL has no receive-from-any; receive control messages on "
                             "a Gloo control group (Communicator(control=True)) and the "
                             "data from the sender it names")
        st = self._stage([], [tensor])
        work = self._run("recv_any", tensor, lambda a: dist.irecv(
            st.writes[0], group=self.group, tag=tag), True, stage=st)
        work.wait()
        return work.work._source_rank()


def release_groups(ledger: CollectiveLedger) -> None:
    """After ``dist.destroy_process_group()``: every communicator recording into
    ``ledger`` lets go of its process group, and the groups are freed now.

    A Gloo group's worker threads drop each finished operation a moment after the
    caller saw it complete; an operation that held the last reference to a Python
    tensor then takes the GIL to free it. Were the group freed only at interpreter
    exit, a worker thread still doing that would find the interpreter finalizing and
    abort the whole process ("terminate called without an active exception") after a
    finished run. Freeing the groups here joins their threads while the interpreter is
    whole (torch releases the GIL while a process group is destroyed)."""
    for comm in ledger.members:
        comm.group = None
    ledger.members.clear()
    gc.collect()


def control_beside(comm: Communicator) -> Communicator:
    """A Gloo (CPU) communicator over ``comm``'s ranks, for control messages whose
    values the host reads: ``comm`` itself when it is on the CPU already, else a new
    group (every rank of ``comm`` must call this at the same point)."""
    if comm.device.type == "cpu":
        return comm
    ranks = dist.get_process_group_ranks(comm.group)
    return Communicator(dist.new_group(ranks, backend="gloo"), comm.ledger,
                        f"{comm.name}-control", control=True)
