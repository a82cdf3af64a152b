"""ZeRO's training state as checkpoint pieces: each rank's shards, under global names.

A shard is a flat range of each parameter it touches; with tensor parallelism that
parameter is itself a box of the global tensor. :func:`shard_pieces` turns every such
range (of the parameter and of each of its optimizer-state tensors) into boxes of the
global tensors (:func:`~disttrain.parallel.placement.range_pieces`), so a checkpoint
written at any (dp, pp, tp, stage) loads into any other. :func:`load_shards` reads each
parameter whole by its global name, cuts this rank's tp part and then its flat range.
"""

from __future__ import annotations

import torch

from ..interfaces import StatePiece, TensorSource
from ..placement import Placement, range_pieces
from .flat import FlatParam

MODEL, OPTIM = "model/", "optim/"


def shard_pieces(flats: list[FlatParam], rank: int, placement: Placement,
                 optimizer: torch.optim.Optimizer) -> list[StatePiece]:
    """What this rank saves: its part of every parameter it writes (not a tied copy; a
    tp-replicated one on tp rank 0 only) and of that parameter's optimizer state."""
    out: list[StatePiece] = []
    for f in flats:
        state = optimizer.state.get(f.shard, {})
        for slot, p, name, a, b in f.pieces(rank):
            if not placement.writes(p):
                continue
            where = f.in_shard(rank, slot, a, b)
            boxes = placement.boxes(name, p)
            tensors = [(MODEL + name, f.shard.detach()[where])]
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors.append((f"{OPTIM}{name}/{key}", value[where]))
                elif a == 0 and placement.tp_rank == 0:  # a scalar (Adam's step): once
                    t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                    out.append(StatePiece(f"{OPTIM}{name}/{key}", t.detach(), (), ()))
            for global_name, data in tensors:
                out += [StatePiece(global_name, g.tensor, g.global_shape, g.offsets)
                        for g in range_pieces(boxes, tuple(p.shape), a, b, data)]
    return out


def load_shards(flats: list[FlatParam], rank: int, placement: Placement,
                source: TensorSource, optimizer: torch.optim.Optimizer) -> None:
    """Fill this rank's shards (and their optimizer state) from any checkpoint."""
    for f in flats:
        state: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for slot, p, name, a, b in f.pieces(rank):
                where = f.in_shard(rank, slot, a, b)
                f.shard[where] = _local_range(source, placement, MODEL + name, name, a, b)
                for full_name in source.names(f"{OPTIM}{name}/"):
                    key = full_name.rsplit("/", 1)[1]
                    if source.shape(full_name) == ():
                        state[key] = source.tensor(full_name)
                        continue
                    state.setdefault(key, torch.zeros_like(f.shard))[where] = \
                        _local_range(source, placement, full_name, name, a, b)
        if state:
            optimizer.state[f.shard] = state


def _local_range(source: TensorSource, placement: Placement, tensor_name: str,
                 param_name: str, a: int, b: int) -> torch.Tensor:
    full = source.tensor(tensor_name)
    return placement.to_local(param_name, full).reshape(-1)[a:b]
