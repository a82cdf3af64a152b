"""Cutting the GPT into pipeline chunks.

The model's blocks are split into ``n = pp * v`` contiguous chunks; chunk ``c`` lives on
pp rank ``c % pp``. Chunk 0 also holds ``tok_emb``, ``pos_emb`` and ``drop``; chunk
``n - 1`` also holds ``ln_f`` and ``head``. A :class:`PipelineChunk` is built from the
original model's submodules (the same parameter objects, no copies) and keeps their
names: its ``named_parameters()`` yields ``blocks.3.mlp.up.weight`` etc.

Tied weights: GPT ties ``head.weight`` to ``tok_emb.weight``. With ``pp > 1`` the first
and last chunks are on different ranks, so the last chunk's ``head`` is a copy of the
original head holding its own copy of the tied weight (equal at build time). After
backward, :func:`sync_tied_grads` sums the two copies' gradients between the first and
the last stage, so both receive the same update and stay equal. The copy's full-model
name is ``tok_emb.weight`` (see :func:`chunk_param_names`); a checkpoint writer saves it
from its owner, chunk 0, and skips the names in ``PipelineChunk.tied_copies``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...comm.collectives import Communicator
from ...config.schema import ModelConfig

TIED_OWNER, TIED_COPY = "tok_emb.weight", "head.weight"
# Above any tag the runner uses, so the exchange never matches an activation message.
_TIED_TAG = 1 << 24


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Relative cost of each piece (any unit, e.g. FLOPs per token)."""

    embedding: float
    blocks: tuple[float, ...]
    head: float


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """Chunk ``c`` holds blocks ``bounds[c] : bounds[c + 1]`` and lives on rank c % pp."""

    pp: int
    v: int
    bounds: tuple[int, ...]

    @property
    def n_chunks(self) -> int:
        return self.pp * self.v

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def chunks_of(self, rank: int) -> list[int]:
        """Global chunk indices on pp rank ``rank``, in local order."""
        return list(range(rank, self.n_chunks, self.pp))


def estimate_costs(cfg: ModelConfig) -> StageCosts:
    """Forward FLOPs per token of each piece (backward is about twice as much for all).

    A block: 2 x 12 d^2 for its matmuls plus 4 T d for attention scores and the
    weighted sum; the head: 2 d V (plus the loss, a few V); the embedding: lookups and
    the position add, about d (memory-bound, costed as d).
    """
    d, t, vocab = cfg.d_model, cfg.seq_len, cfg.vocab_size
    block = 24 * d * d + 4 * t * d
    return StageCosts(embedding=float(d), blocks=(float(block),) * cfg.n_layer,
                      head=float(2 * d * vocab + 5 * vocab))


def plan_stages(cfg: ModelConfig, *, pp: int, v: int = 1, cuts: Sequence[int] | None = None,
                costs: StageCosts | None = None) -> StagePlan:
    """Cut ``cfg.n_layer`` blocks into ``pp * v`` chunks.

    ``cuts``: the first block of chunks 1 .. n-1 (n - 1 increasing indices in
    1 .. n_layer - 1). Without it, the contiguous partition minimising the largest chunk
    cost under ``costs`` (default :func:`estimate_costs`), the embedding counted on the
    first chunk and the head on the last.
    """
    n, layers = pp * v, cfg.n_layer
    if pp < 1 or v < 1:
        raise ValueError(f"pp={pp} and v={v} must both be at least 1")
    if n > layers:
        raise ValueError(f"pp x v = {pp}x{v} = {n} chunks but the model has only "
                         f"n_layer={layers} blocks (each chunk needs one); lower pp or v")
    if cuts is None:
        cuts = balanced_cuts(costs or estimate_costs(cfg), n)
    cuts = list(cuts)
    if len(cuts) != n - 1:
        raise ValueError(f"{n} chunks need {n - 1} cut points, got {len(cuts)}: {cuts}; "
                         "give the first block index of every chunk but the first")
    bounds = [0, *cuts, layers]
    for a, b in zip(bounds, bounds[1:]):
        if not a < b:
            raise ValueError(f"cut points {cuts} must increase strictly within 1.."
                             f"{layers - 1} (n_layer={layers}), so every chunk has a block")
    return StagePlan(pp=pp, v=v, bounds=tuple(bounds))


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


class PipelineChunk(nn.Module):
    """Chunk ``index`` of a GPT: blocks ``bounds[index] : bounds[index + 1]``.

    Input: the first chunk takes input_ids [B, T] (long), the others activations
    [B, T, d]. Output: the last chunk returns logits [B, T, V], the others [B, T, d].
    """

    def __init__(self, model: nn.Module, plan: StagePlan, index: int) -> None:
        super().__init__()
        self.index = index
        self.is_first, self.is_last = index == 0, index == plan.n_chunks - 1
        self.tied_copies: tuple[str, ...] = ()
        self.tie_peer: int | None = None  # pp rank holding the other copy of the tied weight
        start, stop = plan.bounds[index], plan.bounds[index + 1]
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        # Named by the block's index in the full model, so parameter names are kept.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, stop)})
        if self.is_last:
            self.ln_f = model.ln_f
            self.head = model.head
        tied = model.head.weight is model.tok_emb.weight
        if tied and plan.pp > 1 and (self.is_first or self.is_last):
            self.tie_peer = plan.rank_of(plan.n_chunks - 1 if self.is_first else 0)
        if tied and self.is_last and not self.is_first and plan.pp > 1:
            self.head = copy.deepcopy(model.head)  # own Parameter, same values
            self.head.weight.grad = None
            self.tied_copies = (TIED_COPY,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x

    def tied_weight(self) -> nn.Parameter | None:
        """This chunk's copy of the tied embedding/head weight, if another stage holds
        the other copy."""
        if self.tie_peer is None:
            return None
        return self.tok_emb.weight if self.is_first else self.head.weight


def build_chunks(model: nn.Module, plan: StagePlan, rank: int) -> list[PipelineChunk]:
    """The chunks living on pp rank ``rank`` (global indices ``plan.chunks_of(rank)``)."""
    if len(model.blocks) != plan.bounds[-1]:
        raise ValueError(f"the plan cuts {plan.bounds[-1]} blocks but the model has "
                         f"{len(model.blocks)}; plan with the model's own config")
    return [PipelineChunk(model, plan, c) for c in plan.chunks_of(rank)]


def chunk_param_names(chunk: PipelineChunk) -> dict[str, str]:
    """Parameter name in ``chunk`` -> the full model's parameter name (identical except
    the tied copy ``head.weight`` -> ``tok_emb.weight``)."""
    return {name: (TIED_OWNER if name in chunk.tied_copies else name)
            for name, _ in chunk.named_parameters()}


def sync_tied_grads(chunks: Sequence[PipelineChunk], comm: Communicator) -> None:
    """Sum the tied weight's gradient [V, d] between its two copies (first stage's
    ``tok_emb.weight``, last stage's ``head.weight``) after backward, over the pp group
    ``comm``: each side sends its gradient and adds the other's, so both end bitwise
    equal. Other ranks, and pp = 1 (one shared parameter), do nothing. Call it on every
    pp rank, after the pipeline's backward and before the optimizer step."""
    for chunk in chunks:
        weight = chunk.tied_weight()
        if weight is None:
            continue
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        mine, theirs = weight.grad.detach().clone(), torch.empty_like(weight.grad)
        works = [comm.isend(mine, chunk.tie_peer, _TIED_TAG),
                 comm.irecv(theirs, chunk.tie_peer, _TIED_TAG)]
        for work in works:
            work.wait()
        weight.grad.add_(theirs)
