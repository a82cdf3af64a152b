"""Clipping by a global gradient norm whose square is summed over a group, on the device.

Nothing here is read on the host: the norm and the clip factor stay 0-dim tensors, so a
step on a GPU never waits for its gradients to be summed before it queues the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.collectives import Communicator


def clip_by_norm(grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` by min(1, max_norm / (norm + 1e-6)) in place when ``max_norm > 0``
    (as ``torch.nn.utils.clip_grad_norm_`` does); a factor of 1 leaves every bit as it
    was. A non-finite norm makes the gradients non-finite (the step is skipped)."""
    if max_norm <= 0 or not grads:
        return
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._foreach_mul_(same, factor.to(same[0].dtype))


def clip_to_global_norm(grads: Sequence[torch.Tensor], sq: torch.Tensor,
                        comm: Communicator, max_norm: float) -> torch.Tensor:
    """``sq`` (float64 [1]): this rank's share of the squared global norm; summed over
    ``comm`` (in place), its root is the norm returned (a 0-dim float64 tensor on the
    device). ``grads`` are clipped as :func:`clip_by_norm` says."""
    comm.all_reduce(sq)
    norm = sq.sqrt().reshape(())
    clip_by_norm(grads, norm, max_norm)
    return norm


def squared_norm(grads: Sequence[torch.Tensor], device: torch.device,
                 weights: Sequence[float] | None = None) -> torch.Tensor:
    """sum_i w_i ||g_i||^2 in float64 as a [1] tensor on ``device`` (``weights``:
    default 1 each), without a host read."""
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for i, g in enumerate(grads):
        term = torch.linalg.vector_norm(g.detach(), dtype=torch.float64).square()
        sq += term if weights is None else term * weights[i]
    return sq


def local_grad_norm(params: Sequence[torch.Tensor], max_norm: float,
                    device: torch.device) -> torch.Tensor:
    """The norm of ``params``' gradients, all held by this rank (replicas, or a rank's
    own), clipped to ``max_norm`` if it is > 0 (torch's ``clip_grad_norm_``, which
    neither reads nor syncs); a 0-dim tensor on ``device``."""
    if not params:
        return torch.zeros((), device=device)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
