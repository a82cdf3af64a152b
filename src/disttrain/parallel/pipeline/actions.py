"""What a pipeline schedule is made of (see :mod:`.schedules` for how each is built): an
action, one pass of one chunk on one micro-batch (``F`` forward, ``B`` backward or in a
split schedule its input-gradient half, ``W`` the weight-gradient half), each rank's
ordered actions, and which rank holds a chunk. Pure Python, imported by the schedules'
builders, the simulator and the runner alike."""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


@dataclass(frozen=True)
class Action:
    """One forward, backward (or input-gradient) or weight-gradient pass of one chunk on
    one micro-batch."""

    kind: str  # FORWARD, BACKWARD or WEIGHT
    chunk: int  # global chunk index, 0 .. pp*v - 1
    micro: int  # micro-batch index, 0 .. m - 1

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.micro}"


class ChunkPlacement:
    """Where the ``pp * v`` chunks of a pipeline live, for a dataclass with fields
    ``pp``, ``v`` and ``vshape``: chunk ``c`` on rank :func:`chunk_rank`."""

    pp: int
    v: int
    vshape: bool

    @property
    def n_chunks(self) -> int:
        return self.pp * self.v

    def rank_of(self, chunk: int) -> int:
        return chunk_rank(chunk, self.pp, self.vshape)


@dataclass(frozen=True, kw_only=True)
class Schedule(ChunkPlacement):
    """``actions[r]``: pp rank r's actions, in the order it runs them; ``split``: the
    backward is split into B (input gradient) and W (weight gradients); ``vshape``:
    chunks placed in a V (see the module docstring)."""

    name: str
    pp: int
    m: int
    v: int
    actions: tuple[tuple[Action, ...], ...]
    split: bool = False
    vshape: bool = False


def chunk_rank(chunk: int, pp: int, vshape: bool) -> int:
    """The pp rank of global chunk ``chunk``: ``chunk % pp``, or in a V every other
    group of ``pp`` chunks runs back up (``pp - 1 - chunk % pp``)."""
    group, offset = divmod(chunk, pp)
    return pp - 1 - offset if vshape and group % 2 else offset
