"""Clipping by a global gradient norm whose square is summed over a group."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..comm.collectives import Communicator


def clip_to_global_norm(grads: Iterable[torch.Tensor], sq: torch.Tensor,
                        comm: Communicator, max_norm: float) -> float:
    """``sq`` (float64 [1]): this rank's share of the squared global norm; summed over
    ``comm`` (in place), its root is the norm returned. When ``max_norm > 0`` and the
    norm exceeds it, ``grads`` are scaled by max_norm / (norm + 1e-6), as
    ``torch.nn.utils.clip_grad_norm_`` does."""
    comm.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm
