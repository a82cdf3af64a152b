"""ZeRO's training state as checkpoint pieces: each rank's shards, under global names.

A shard is a flat range of each parameter it touches; with tensor parallelism that
parameter is itself a box of the global tensor. :func:`shard_pieces` turns every such
range (of the parameter and of each of its optimizer-state tensors) into boxes of the
global tensors (:func:`~disttrain.parallel.placement.range_pieces`), so a checkpoint
written at any (dp, pp, tp, stage) loads into any other. :func:`load_shards` reads each
parameter whole by its global name, cuts this rank's tp part and then its flat range.

State that differs on every dp rank (1-bit Adam's worker residual, flat over a whole
buffer) is saved by each rank as its row of a [dp, *shape] tensor per parameter
(:func:`rank_pieces`) and read back by :func:`load_rank_state`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..interfaces import TensorSource, rank_local_state
from ..placement import Placement, StatePiece, range_pieces, tensor_pieces
from ..replicated import rank_row_pieces, read_rank_row
from .flat import FlatParam

MODEL, OPTIM = "model/", "optim/"


def shard_pieces(flats: list[FlatParam], rank: int, placement: Placement,
                 optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
    """What this rank saves: its part of every parameter it writes (not a tied copy; a
    tp-replicated one on tp rank 0 only) and of that parameter's optimizer state (none
    without an ``optimizer``: frozen parameters)."""
    out: list[StatePiece] = []
    for f in flats:
        state = {} if optimizer is None else optimizer.state.get(f.shard, {})
        for slot, p, name, a, b in f.pieces(rank):
            if not placement.writes(p):
                continue
            where = f.in_shard(rank, slot, a, b)
            boxes = placement.boxes(name, p)
            tensors = [(MODEL + name, f.shard.detach()[where])]
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors.append((f"{OPTIM}{name}/{key}", value[where]))
                elif a == 0 and placement.leads:  # a scalar (Adam's step): once
                    t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                    out.append(StatePiece(f"{OPTIM}{name}/{key}", t.detach(), (), ()))
            for global_name, data in tensors:
                out += range_pieces(global_name, boxes, tuple(p.shape), a, b, data)
    return out


def rank_pieces(flats: list[FlatParam], placement: Placement,
                optimizer: torch.optim.Optimizer, dp_rank: int,
                dp_size: int) -> list[StatePiece]:
    """What this rank saves of the optimizer's per-rank state (``rank_state(shard)``:
    flat tensors over each buffer's real elements), per parameter it writes."""
    local = rank_local_state(optimizer)
    if local is None:
        return []
    out: list[StatePiece] = []
    for f in flats:
        for key, flat in local.rank_state(f.shard).items():
            for p, name, view in zip(f.params, f.names, f.views(flat), strict=True):
                if placement.writes(p):
                    out += rank_row_pieces(placement, name, p, key, view, dp_rank, dp_size)
    return out


def load_rank_state(flats: list[FlatParam], placement: Placement, source: TensorSource,
                    optimizer: torch.optim.Optimizer, dp_rank: int, dp_size: int) -> None:
    """Give the optimizer its per-rank state back (``load_rank_state(shard, key,
    flat)``), for each buffer that has any saved; a parameter without it starts at 0."""
    local = rank_local_state(optimizer)
    if local is None:
        return
    for key in local.rank_keys:
        for f in flats:
            parts, found = [], False
            for p, name in zip(f.params, f.names, strict=True):
                full = f"{OPTIM}{name}/{key}"
                if full in source.names(full):
                    row = read_rank_row(source, full, MODEL + name, dp_rank, dp_size)
                    parts.append(placement.to_local(name, row).reshape(-1))
                    found = True
                else:
                    parts.append(torch.zeros(p.numel()))
            if found:
                local.load_rank_state(f.shard, key, torch.cat(parts).to(f.full.device))


def load_shards(flats: list[FlatParam], rank: int, placement: Placement,
                source: TensorSource, optimizer: torch.optim.Optimizer) -> None:
    """Fill this rank's shards (and their optimizer state, but the optimizer's
    ``rank_keys``) from any checkpoint."""
    local = rank_local_state(optimizer)
    skip = set(local.rank_keys if local is not None else ())
    for f in flats:
        state: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for slot, _p, name, a, b in f.pieces(rank):
                where = f.in_shard(rank, slot, a, b)
                f.shard[where] = _local_range(source, placement, MODEL + name, name, a, b)
                for full_name in source.names(f"{OPTIM}{name}/"):
                    key = full_name.rsplit("/", 1)[1]
                    if key in skip:
                        continue
                    if source.shape(full_name) == ():
                        state[key] = source.tensor(full_name)
                        continue
                    if tuple(source.shape(full_name)) != tuple(source.shape(MODEL + name)):
                        raise ValueError(f"{full_name}: checkpoint shape "
                                         f"{list(source.shape(full_name))} does not fit its "
                                         f"parameter ({list(source.shape(MODEL + name))})")
                    state.setdefault(key, torch.zeros_like(f.shard))[where] = \
                        _local_range(source, placement, full_name, name, a, b)
        if state:
            optimizer.state[f.shard] = state


def _local_range(source: TensorSource, placement: Placement, tensor_name: str,
                 param_name: str, a: int, b: int) -> torch.Tensor:
    full = source.tensor(tensor_name)
    return placement.to_local(param_name, full).reshape(-1)[a:b]


def whole_pieces(params: Sequence[torch.Tensor], placement: Placement) -> list[StatePiece]:
    """Whole (or tensor-parallel boxes of) ``params`` this rank writes, as pieces of
    their global tensors."""
    out: list[StatePiece] = []
    for p in params:
        if placement.writes(p):
            name = placement.name(p)
            out += tensor_pieces(MODEL + name, placement.boxes(name, p), p.detach())
    return out


def load_frozen(flats: list[FlatParam], whole: Sequence[torch.Tensor], rank: int,
                placement: Placement, source: TensorSource) -> None:
    """The frozen parameters ``source`` holds: this rank's range of each one in the
    stage-3 ``flats``, and each of the ``whole`` ones (stages 1-2). A checkpoint holds
    none (they come from the run's initial source), so absent ones are left as they are."""
    with torch.no_grad():
        for f in flats:
            for slot, _p, name, a, b in f.pieces(rank):
                if MODEL + name in source.names(MODEL + name):
                    f.shard[f.in_shard(rank, slot, a, b)] = _local_range(
                        source, placement, MODEL + name, name, a, b)
        for p in whole:
            name = placement.name(p)
            if MODEL + name in source.names(MODEL + name):
                p.copy_(placement.to_local(name, source.tensor(MODEL + name)))
