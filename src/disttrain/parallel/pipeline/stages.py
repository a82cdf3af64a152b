"""Cutting a model into pipeline chunks, by its spec.

The model's blocks (``spec.blocks``) are split into ``n = pp * v`` contiguous chunks;
chunk ``c`` lives on pp rank ``c % pp``. Chunk 0 also holds the modules that run before
the blocks (``spec.before``: the embeddings), chunk ``n - 1`` those that run after
(``spec.after``: final norm, head). A :class:`PipelineChunk` is built from the original
model's submodules (the same parameter objects, no copies) under the same paths, so its
``named_parameters()`` keep the model's names (``blocks.3.mlp.up.weight``).

Tied weights (``spec.tied``: the GPT ties ``head.weight`` to ``tok_emb.weight``): with
``pp > 1`` the first and last chunks are on different ranks, so the last chunk holds a
copy of the module owning the tied copy, with its own copy of the weight (equal at
build time). After backward the two copies' gradients are summed between the first and
the last stage (:func:`exchange_tied_grads`), so both receive the same update and stay
equal. The copy's full-model name is the owner's (see :func:`chunk_param_names`); a
checkpoint writer saves it from chunk 0 and skips the names in
``PipelineChunk.tied_copies``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...comm.collectives import Communicator
from ...spec import ModelSpec, block_list

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


def spec_costs(spec: ModelSpec) -> StageCosts:
    """The relative cost of each piece, from the model's spec."""
    return StageCosts(embedding=spec.embedding_cost, blocks=tuple(spec.block_costs),
                      head=spec.head_cost)


def plan_stages(spec: ModelSpec, *, pp: int, v: int = 1, cuts: Sequence[int] | None = None,
                costs: StageCosts | None = None) -> StagePlan:
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
    """Chunk ``index`` of a model: blocks ``bounds[index] : bounds[index + 1]``, plus
    ``spec.before`` on the first chunk and ``spec.after`` on the last.

    Input: the first chunk takes the model's input (e.g. input_ids [B, T]), the others
    activations [B, T, hidden]. Output: the last chunk returns the model's output (e.g.
    logits [B, T, V]), the others [B, T, hidden].
    """

    def __init__(self, model: nn.Module, spec: ModelSpec, plan: StagePlan,
                 index: int) -> None:
        super().__init__()
        self.index, self.spec = index, spec
        self.is_first, self.is_last = index == 0, index == plan.n_chunks - 1
        self.tied_copies: tuple[str, ...] = ()
        self.tied_pairs: list[tuple[str, int]] = []  # (local name, peer pp rank)
        start, stop = plan.bounds[index], plan.bounds[index + 1]
        for path in spec.before if self.is_first else ():
            _attach(self, path, model.get_submodule(path))
        blocks = block_list(model, spec)
        # Named by the block's index in the full model, so parameter names are kept.
        _attach(self, spec.blocks, nn.ModuleDict({str(i): blocks[i]
                                                  for i in range(start, stop)}))
        for path in spec.after if self.is_last else ():
            _attach(self, path, model.get_submodule(path))
        split = plan.pp > 1 and not (self.is_first and self.is_last)
        for owner, copy_name in spec.tied if split else ():
            if model.get_parameter(owner) is not model.get_parameter(copy_name):
                continue
            if self.is_first:
                self.tied_pairs.append((owner, plan.rank_of(plan.n_chunks - 1)))
            elif self.is_last:  # own module and Parameter, same values
                holder = copy_name.rpartition(".")[0]
                _attach(self, holder, copy.deepcopy(model.get_submodule(holder)))
                self.get_parameter(copy_name).grad = None
                self.tied_copies += (copy_name,)
                self.tied_pairs.append((copy_name, plan.rank_of(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.spec.embed(self, x)
        for block in self.get_submodule(self.spec.blocks).values():
            x = block(x)
        if self.is_last:
            x = self.spec.finish(self, x)
        return x

    @property
    def tie_peer(self) -> int | None:
        """The pp rank holding the other copy of this chunk's tied weight, if any."""
        return self.tied_pairs[0][1] if self.tied_pairs else None

    def tied_weights(self) -> list[tuple[nn.Parameter, int]]:
        """This chunk's copies of tied weights whose other copy lives on another pp
        rank, with that rank."""
        return [(self.get_parameter(name), peer) for name, peer in self.tied_pairs]


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Set ``module`` at dotted ``path`` under ``root``, creating plain holder modules
    for the intermediate names (so parameter names match the full model's)."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if name not in node._modules:
            node.add_module(name, nn.Module())
        node = node._modules[name]
    node.add_module(leaf, module)


def build_chunks(model: nn.Module, spec: ModelSpec, plan: StagePlan,
                 rank: int) -> list[PipelineChunk]:
    """The chunks living on pp rank ``rank`` (global indices ``plan.chunks_of(rank)``)."""
    if not spec.can_pipeline:
        raise ValueError("this model's spec does not say how to cut it (blocks, before/"
                         "after modules, embed/finish); pass a ModelSpec that does")
    blocks = block_list(model, spec)
    if len(blocks) != plan.bounds[-1]:
        raise ValueError(f"the plan cuts {plan.bounds[-1]} blocks but the model has "
                         f"{len(blocks)}; plan with the model's own spec")
    return [PipelineChunk(model, spec, plan, c) for c in plan.chunks_of(rank)]


def chunk_param_names(chunk: PipelineChunk) -> dict[str, str]:
    """Parameter name in ``chunk`` -> the full model's parameter name (identical except
    a tied copy, which is named after its owner)."""
    owners = {c: o for o, c in chunk.spec.tied}
    return {name: (owners[name] if name in chunk.tied_copies else name)
            for name, _ in chunk.named_parameters()}


def exchange_tied_grads(pairs: Sequence[tuple[torch.Tensor, int]],
                        comm: Communicator) -> None:
    """Sum each tied weight's gradient (or this rank's piece of it) with the peer
    holding the other copy, over the pp group ``comm``: each side sends its gradient
    and adds the other's, so both end bitwise equal. ``pairs``: (gradient tensor, peer
    pp rank); both sides must pass pieces of the same shape in the same order."""
    for grad, peer in pairs:
        mine, theirs = grad.detach().clone(), torch.empty_like(grad)
        works = [comm.isend(mine, peer, _TIED_TAG), comm.irecv(theirs, peer, _TIED_TAG)]
        for work in works:
            work.wait()
        grad.add_(theirs)


def sync_tied_grads(chunks: Sequence[PipelineChunk], comm: Communicator) -> None:
    """:func:`exchange_tied_grads` on the chunks' own ``.grad`` (a missing gradient
    counts as zero). Call it on every pp rank, after the pipeline's backward and before
    the optimizer step; pp = 1 (one shared parameter) does nothing."""
    pairs = []
    for chunk in chunks:
        for weight, peer in chunk.tied_weights():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            pairs.append((weight.grad, peer))
    exchange_tied_grads(pairs, comm)
