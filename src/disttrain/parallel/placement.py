"""Where this rank's parameters sit in the global model, and pieces of global tensors.

A :class:`Placement` answers, for every parameter this rank holds: its name in the full
model, the boxes placing its local tensor in the global one (the dimension that shards
tensors, tensor parallelism, gives them), whether it is a copy of a weight saved
elsewhere (a tied weight's second copy in a pipeline) or identical on every rank of the
sharding group (written by that group's rank 0 only), and the share of its squared
gradient norm this rank contributes. The whole model on one rank is the trivial case.

:func:`range_pieces` cuts a flat range of a local tensor into boxes of the global tensor,
so a ZeRO shard (a flat range) of a tensor-parallel shard (a box) is still a set of boxes
that any layout can load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class Box:
    """A block shared by a local tensor and the global tensor it is a shard of:
    ``local[local_offsets + i] == global[global_offsets + i]`` for every i < ``shape``
    (all tuples have one entry per dimension)."""

    local_offsets: tuple[int, ...]
    global_offsets: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]

    def local_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.local_offsets, self.shape, strict=True))

    def global_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.global_offsets, self.shape, strict=True))


def whole_box(shape: tuple[int, ...]) -> list[Box]:
    """A replicated tensor: one box covering all of it."""
    zeros = (0,) * len(shape)
    return [Box(local_offsets=zeros, global_offsets=zeros, shape=tuple(shape),
                global_shape=tuple(shape))]


BoxesFn = Callable[[str, torch.Tensor], list[Box]]


@dataclass(frozen=True)
class StatePiece:
    """A box of a named global tensor held by this rank: the one type for a region of a
    global tensor (placements give them, states save and load them, the final weights
    are written from them).

    ``name``: ``model/<parameter>`` or ``optim/<parameter>/<key>``; ``global_shape`` and
    ``offsets``: where the box lies (``()`` for a scalar); ``tensor``: its data (a view
    that the checkpoint copies); ``eager``: changes during the forward pass (buffers),
    so an asynchronous save copies it at once.
    """

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    eager: bool = False

    @property
    def is_whole(self) -> bool:
        """Whether the piece is the whole global tensor (no sharding)."""
        return tuple(self.tensor.shape) == tuple(self.global_shape) and \
            not any(self.offsets)


@dataclass
class Placement:
    """How the parameters this rank holds map to the full model's.

    ``names``: id(parameter) -> full-model name. ``copies``: ids of parameters that
    duplicate one saved by another rank (never saved, weight 0 in norms).
    ``replicated``: ids identical on every rank of the sharding group, rank
    ``shard_rank`` of ``shards`` (saved by its rank 0 only, weight 1/shards in norms).
    ``boxes`` / ``to_local``: the sharding's boxes per name and the cut of a global
    tensor to this rank's local one (identity without sharding).
    """

    names: dict[int, str]
    copies: set[int] = field(default_factory=set)
    replicated: set[int] = field(default_factory=set)
    shard_rank: int = 0
    shards: int = 1
    boxes_fn: BoxesFn | None = None
    to_local_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None

    def name(self, param: torch.Tensor) -> str:
        """The global (full-model) name of this rank's parameter ``param``."""
        return self.names[id(param)]

    def boxes(self, name: str, param: torch.Tensor) -> list[Box]:
        """Where ``param`` (this rank's tensor for ``name``) lies in the global tensor."""
        if self.boxes_fn is None:
            return whole_box(tuple(param.shape))
        return self.boxes_fn(name, param)

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor for ``name``, cut from the global ``full``."""
        return full if self.to_local_fn is None else self.to_local_fn(name, full)

    @property
    def leads(self) -> bool:
        """Whether this rank writes what every rank of its sharding group holds alike
        (a replicated tensor, a scalar of optimizer state, a buffer): its rank 0."""
        return self.shard_rank == 0

    def writes(self, param: torch.Tensor) -> bool:
        """Whether this rank (among the ranks holding ``param``'s data, before any data
        parallelism) saves it: never a copy; a replicated one on the group's rank 0."""
        if id(param) in self.copies:
            return False
        return id(param) not in self.replicated or self.leads

    def norm_weight(self, param: torch.Tensor) -> float:
        """The share of ``param``'s squared gradient norm this rank contributes (before
        dividing out data-parallel replicas)."""
        if id(param) in self.copies:
            return 0.0
        return 1.0 / self.shards if id(param) in self.replicated else 1.0


def whole_model_placement(module: nn.Module,
                          canonical: Callable[[str], str] = lambda n: n) -> Placement:
    """The trivial placement: this rank holds every parameter of ``module`` whole."""
    return Placement(names={id(p): canonical(n) for n, p in module.named_parameters()})


def range_boxes(shape: tuple[int, ...], start: int, stop: int
                ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes (offsets, sizes, flat start) covering elements ``[start, stop)`` of the
    row-major flattening of a tensor of ``shape``; each box is contiguous in that
    flattening (at most 2 x ndim - 1 of them)."""
    if start >= stop:
        return
    if len(shape) <= 1:
        yield (start,), (stop - start,), start
        return
    inner = 1
    for s in shape[1:]:
        inner *= s
    row, col = divmod(start, inner)
    last_row, last_col = divmod(stop, inner)
    if row == last_row:  # inside one row: recurse into it
        for offs, sizes, flat in range_boxes(shape[1:], col, last_col):
            yield (row, *offs), (1, *sizes), row * inner + flat
        return
    if col:
        yield from range_boxes(shape, start, (row + 1) * inner)
        row += 1
    if last_row > row:
        yield (row, *(0,) * (len(shape) - 1)), (last_row - row, *shape[1:]), row * inner
    if last_col:
        yield from range_boxes(shape, last_row * inner, stop)


def range_pieces(name: str, boxes: list[Box], local_shape: tuple[int, ...], start: int,
                 stop: int, data: torch.Tensor) -> list[StatePiece]:
    """The pieces of global tensor ``name`` held by elements ``[start, stop)`` of a local
    tensor of ``local_shape`` whose boxes are ``boxes``; ``data`` [stop - start] holds
    those elements (e.g. a slice of a ZeRO shard)."""
    out = []
    for offs, sizes, flat in range_boxes(tuple(local_shape), start, stop):
        segment = data[flat - start:flat - start + _numel(sizes)].view(sizes)
        for b in boxes:
            lo = [max(o, bo) for o, bo in zip(offs, b.local_offsets, strict=True)]
            hi = [min(o + s, bo + bs) for o, s, bo, bs in
                  zip(offs, sizes, b.local_offsets, b.shape, strict=True)]
            if any(a >= z for a, z in zip(lo, hi, strict=True)):
                continue
            view = segment[tuple(slice(a - o, z - o) for a, z, o in zip(lo, hi, offs, strict=True))]
            glob = tuple(g + a - lo_b for g, a, lo_b in
                         zip(b.global_offsets, lo, b.local_offsets, strict=True))
            out.append(StatePiece(name, view, b.global_shape, glob))
    return out


def tensor_pieces(name: str, boxes: list[Box], tensor: torch.Tensor) -> list[StatePiece]:
    """A whole local tensor as pieces of global tensor ``name`` (one per box)."""
    return [StatePiece(name, tensor[b.local_slices()], b.global_shape, b.global_offsets)
            for b in boxes]


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
