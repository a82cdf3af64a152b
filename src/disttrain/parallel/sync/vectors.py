"""Flat parameter vectors, and their average over a group: what the periodic modes
exchange."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...comm.collectives import Communicator


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new fp32 vector [sum of numel] holding ``tensors`` in order."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` [sum of numel] into ``tensors``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view(t.shape))
        offset += n


def weighted_average(comm: Communicator, tensors: Sequence[torch.Tensor],
                     weight: float) -> float:
    """Replace ``tensors`` on every rank by sum_r w_r x_r / sum_r w_r over ``comm``
    (one all-reduce of [numel + 1] values); returns the total weight. A rank with
    weight 0 contributes nothing; if every weight is 0 the tensors are left alone."""
    flat = flatten(tensors)
    packed = torch.cat([flat * weight, flat.new_tensor([weight])])
    comm.all_reduce(packed)
    total = float(packed[-1])
    if total > 0:
        unflatten_into(packed[:-1] / total, tensors)
    return total
