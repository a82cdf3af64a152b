"""Where this rank's part of the composed model meets whole tensors: filled from a
source of global tensors (:func:`fill`, each rank reading only the boxes it holds,
:func:`local_boxes`), and written out as boxes of global tensors for the final weights
and the frozen parameters' fingerprint (:func:`weight_pieces`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..checkpoint.state import MODEL
from ..weights.materialize import fill_buffers, persistent_buffers
from .compose import Parallelized
from .interfaces import PartialSource, TensorSource
from .placement import StatePiece, tensor_pieces


def local_boxes(parallel: Parallelized, optimizer: torch.optim.Optimizer
                ) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """``model/<name>`` -> the (global offsets, sizes) boxes of that tensor this rank
    holds: its tensor-parallel boxes, or under ZeRO the boxes of its shard's range
    (a tensor this rank holds but does not save, such as a tied copy, is absent:
    read whole). What a :class:`~.interfaces.PartialSource` reads for it."""
    if parallel.zero_stage:
        out: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        for piece in parallel.state.state_pieces(optimizer) + parallel.state.frozen_pieces():
            if piece.name.startswith(MODEL):
                out.setdefault(piece.name, []).append(
                    (piece.offsets, tuple(piece.tensor.shape)))
        return out
    return {MODEL + parallel.placement.name(p): [
        (b.global_offsets, b.shape)
        for b in parallel.placement.boxes(parallel.placement.name(p), p)]
        for p in parallel.module.parameters() if id(p) in parallel.placement.names}


def fill(parallel: Parallelized, source: TensorSource,
         optimizer: torch.optim.Optimizer) -> None:
    """Give this rank's part of a model built on the meta device its values from
    ``source`` (global tensors by ``model/<name>``: the seeded initialiser, a
    pretrained directory), each rank reading only what it holds; then whatever
    follows the weights (a sync mode's round) starts from them."""
    if isinstance(source, PartialSource):
        source.want(local_boxes(parallel, optimizer))
    parallel.state.load_state(source, optimizer)
    # buffers by their full-model names: a pipeline chunk keeps the model's paths
    for part in parallel.model_parallel.cut.buffer_holders():
        fill_buffers(part, source)
    parallel.sync.restart()


def weight_pieces(parallel: Parallelized, optimizer: torch.optim.Optimizer
                  ) -> list[StatePiece]:
    """The pieces of the model's weights this rank contributes to the final weights
    (``model/<name>`` boxes of global tensors; over all ranks they cover every
    parameter, and every persistent buffer, at least once): under ZeRO each rank's
    shard pieces, else the data-parallel rank 0 replicas' parameters (their boxes
    where a dimension changed the model). No rank gathers anything: the writer
    assembles one tensor at a time. Valid before ``grads.finalize()``."""
    world, replicas = parallel.groups.world, parallel.groups.replicas
    whole = not parallel.model_parallel.applied
    if parallel.zero_stage:
        pieces = [p for p in parallel.state.state_pieces(optimizer)
                  if p.name.startswith(MODEL)] + parallel.state.frozen_pieces()
    elif replicas.rank != 0:
        pieces = []
    elif whole:
        pieces = [StatePiece(MODEL + parallel.placement.name(p), p.detach(),
                             tuple(p.shape), (0,) * p.dim())
                  for p in _unique(parallel.module.parameters())] if world.rank == 0 else []
    else:
        pieces = [piece for name, p in parallel.model_parallel.named_parameters()
                  if parallel.placement.writes(p)
                  for piece in tensor_pieces(MODEL + name, parallel.placement.boxes(name, p),
                                             p.detach())]
    if whole and world.rank == 0:  # buffers the model saves (whole)
        pieces += [StatePiece(MODEL + n, b.detach(), tuple(b.shape), (0,) * b.dim())
                   for n, b in persistent_buffers(parallel.module)]
    return pieces


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
