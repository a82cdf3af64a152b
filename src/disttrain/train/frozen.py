"""The run's frozen parameters, fingerprinted once their values are in.

Checkpoints hold what trains (:meth:`~disttrain.parallel.interfaces.ShardedState.
state_pieces`); the frozen parameters come from the run's source on every start. Their
fingerprint (:mod:`disttrain.checkpoint.fingerprint`) is computed once after the model
is filled, from the pieces every rank contributes to the final weights (each element
once over the world), recorded in every checkpoint and compared on a resume.
"""

from __future__ import annotations

from typing import cast

import torch

from ..checkpoint.fingerprint import piece_checksums
from ..checkpoint.state import MODEL
from ..comm import Communicator
from ..parallel.compose import Parallelized
from ..parallel.pieces import weight_pieces


def frozen_fingerprint(parallel: Parallelized, optimizer: torch.optim.Optimizer,
                       world: Communicator) -> dict[str, list[float]]:
    """Frozen parameter name -> its fingerprint, the same on every rank (collective;
    empty when every parameter trains, after one gather of names)."""
    mine = {parallel.placement.name(p) for p in parallel.module.parameters()
            if not p.requires_grad and id(p) in parallel.placement.names}
    gathered = cast(list[set[str]], world.all_gather_object(mine))
    names = sorted(set().union(*gathered))
    if not names:
        return {}
    index = {MODEL + n: i for i, n in enumerate(names)}
    sums = torch.zeros(len(names), 4, dtype=torch.float64, device=world.device)
    for piece in weight_pieces(parallel, optimizer):
        i = index.get(piece.name)
        if i is not None:
            sums[i] += piece_checksums(piece.tensor, piece.global_shape, piece.offsets)
    world.all_reduce(sums)
    values = sums.cpu().tolist()
    return {n: values[i] for i, n in enumerate(names)}
