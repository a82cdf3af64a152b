"""Where a model is cut into pipeline chunks: the blocks (``spec.blocks``) split into
``n = pp * v`` contiguous chunks, balanced by the blocks' parameter counts; chunk ``c``
on pp rank ``c % pp`` (in a V, :func:`~.actions.chunk_rank`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...spec import ModelSpec
from .actions import ChunkPlacement


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Relative cost of each piece (any unit, e.g. FLOPs per token)."""

    embedding: float
    blocks: tuple[float, ...]
    head: float


@dataclass(frozen=True, kw_only=True)
class StagePlan(ChunkPlacement):
    """Chunk ``c`` holds blocks ``bounds[c] : bounds[c + 1]`` and lives on rank
    ``rank_of(c)`` (c % pp, or in a V when ``vshape``)."""

    pp: int
    v: int
    bounds: tuple[int, ...]
    vshape: bool = False

    def chunks_of(self, rank: int) -> list[int]:
        """Global chunk indices on pp rank ``rank``, in local order."""
        return [c for c in range(self.n_chunks) if self.rank_of(c) == rank]


def spec_costs(spec: ModelSpec) -> StageCosts:
    """The relative cost of each piece, from the model's spec."""
    return StageCosts(embedding=spec.embedding_cost, blocks=tuple(spec.block_costs),
                      head=spec.head_cost)


def plan_stages(spec: ModelSpec, *, pp: int, v: int = 1, cuts: Sequence[int] | None = None,
                costs: StageCosts | None = None, vshape: bool = False) -> StagePlan:
    """Cut the spec's ``n_blocks`` blocks into ``pp * v`` chunks.

    ``cuts``: the first block of chunks 1 .. n-1 (n - 1 increasing indices in
    1 .. n_layer - 1). Without it, the contiguous partition minimising the largest chunk
    cost under ``costs`` (default :func:`spec_costs`), the embedding counted on the
    first chunk and the head on the last.
    """
    n, layers = pp * v, spec.n_blocks
    if pp < 1 or v < 1:
        raise ValueError(f"pp={pp} and v={v} must both be at least 1")
    if n > layers:
        raise ValueError(f"pp x v = {pp}x{v} = {n} chunks but the model has only "
                         f"n_layer={layers} blocks (each chunk needs one); lower pp or v")
    if cuts is None:
        cuts = balanced_cuts(costs or spec_costs(spec), n)
    cuts = list(cuts)
    if len(cuts) != n - 1:
        raise ValueError(f"{n} chunks need {n - 1} cut points, got {len(cuts)}: {cuts}; "
                         "give the first block index of every chunk but the first")
    bounds = [0, *cuts, layers]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if not a < b:
            raise ValueError(f"cut points {cuts} must increase strictly within 1.."
                             f"{layers - 1} (n_layer={layers}), so every chunk has a block")
    return StagePlan(pp=pp, v=v, bounds=tuple(bounds), vshape=vshape)


def balanced_cuts(costs: StageCosts, n_chunks: int) -> list[int]:
    """Cut points of the contiguous partition of ``costs.blocks`` into ``n_chunks``
    non-empty chunks that minimises the largest chunk cost (exact dynamic programme,
    O(n_chunks x n_layer^2))."""
    blocks = costs.blocks
    layers = len(blocks)
    if not 1 <= n_chunks <= layers:
        raise ValueError(f"cannot cut {layers} blocks into {n_chunks} non-empty chunks")
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(chunk: int, a: int, b: int) -> float:
        extra = (costs.embedding if chunk == 0 else 0.0) + (
            costs.head if chunk == n_chunks - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    # best[k][b]: (max cost, previous cut) for blocks[:b] in chunks 0..k
    best = [{b: (cost(0, 0, b), 0) for b in range(1, layers - n_chunks + 2)}]
    for k in range(1, n_chunks):
        row = {}
        for b in range(k + 1, layers - n_chunks + k + 2):
            row[b] = min((max(best[k - 1][a][0], cost(k, a, b)), a)
                         for a in range(k, b))
        best.append(row)
    cuts, b = [], layers
    for k in range(n_chunks - 1, 0, -1):
        b = best[k][b][1]
        cuts.append(b)
    return cuts[::-1]
