"""The ``local`` data-parallel strategy's gradient side: each rank keeps its own
gradient (no communication inside a step), what the modes other than ``every_step``
train on between their rounds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ...comm.collectives import Communicator
from ..clipping import local_grad_norm


class LocalGradients:
    """The DataParallel interface with no communication inside a step: each rank keeps
    its own gradient, normalised by its own loss-term count.

    Parameters and buffers are broadcast from dp rank 0 once, so replicas start equal.
    ``zeros_for_unused``: a parameter that got no gradient in a step gets a zero one,
    as a data-parallel bucket would give it, so the optimizer still steps it (weight
    decay, momentum); otherwise it keeps None and the optimizer skips it. Data
    parallelism over a group of one rank is this class with zeros: nothing to reduce,
    so no buckets, hooks or copies (autograd's own accumulation, as in a plain loop).
    """

    grad_replicas = 1  # each rank's own gradient: its norm is local

    def __init__(self, model: nn.Module, comm: Communicator, broadcast: bool = True,
                 zeros_for_unused: bool = False) -> None:
        self.model, self.comm = model, comm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.zeros_for_unused = zeros_for_unused
        if broadcast:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    comm.broadcast(t.data, src=0)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def backward(self, scope: int, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def reduce_loss_totals(self, totals: torch.Tensor) -> None:
        """Nothing: each rank normalises by its own loss terms."""
        return None

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, p.grad) for p in self.params if p.grad is not None]

    def comm_stats(self) -> dict[str, float]:
        return {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def finish_gradient_sync(self, scale: float | torch.Tensor = 1.0) -> None:
        """No reduction: only the normalisation (1 / this rank's loss-term count)."""
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
            elif self.zeros_for_unused:
                p.grad = torch.zeros_like(p)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """This rank's gradient norm (a 0-dim tensor); clip if ``max_norm > 0``."""
        return local_grad_norm([p for p in self.params if p.grad is not None], max_norm,
                               self.comm.device)

    def after_optimizer_step(self) -> None:
        """Nothing: replicas are reconciled by the sync mode, not here."""

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        grads = sum(p.numel() * p.element_size() for p in self.params)
        optim = sum(v.numel() * v.element_size() for st in optimizer.state.values()
                    for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optim}

    def finalize(self) -> None:
        """Nothing to remove: no hooks were attached."""
