"""What every synchronisation mode shares: the trainer's hooks, local gradients, and
flat parameter vectors.

A mode implements :class:`~..interfaces.SyncStrategy`; the loop calls it at fixed points:

- ``select`` - which dataset indices this rank trains on in a step (fedavg swaps in
  its client's partition, or None when the client sits out a round);
- ``after_step`` - after every optimizer step (rounds end here);
- ``at_boundary`` - whether replicas agree now (checkpoints wait for it);
- ``restart`` - after a checkpoint replaced the parameters (resume);
- ``metrics`` - fields added to metrics records and the summary.

:class:`EveryStep` is ``every_step``: gradients are all-reduced inside each step by
:class:`~disttrain.parallel.ddp.DataParallel`, so there is nothing to do in between.
The other modes step on :class:`LocalGradients` (no communication inside a step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ...comm.collectives import Communicator
from ...names import SYNC_EVERY_STEP
from ..clipping import local_grad_norm


class EveryStep:
    """``every_step``: the per-step gradient all-reduce; every hook is a no-op (the base
    of the other modes)."""

    name = SYNC_EVERY_STEP
    # replicas step on their own gradients between rounds: a nan on one rank is not in
    # any total the others see within the step
    steps_apart = False

    def select(self, step: int, indices: list[int]) -> list[int] | None:
        """This rank's dataset indices for 0-based ``step`` (default: its share of the
        global batch from the global-order sampler); None when it sits the step out."""
        return indices

    def after_step(self, done: int, last: bool) -> None:
        """Called after optimizer step ``done`` (1-based); ``last`` on the final one."""

    def at_boundary(self, done: int) -> bool:
        """Whether every replica holds the same parameters after step ``done``."""
        return True

    def restart(self) -> None:
        """A checkpoint has replaced the parameters: state kept from the old ones (a
        round's starting point) must start from these."""

    def metrics(self) -> dict[str, Any]:
        return {}


class PeriodicSync(EveryStep):
    """A mode whose replicas train apart and are reconciled every ``every`` steps and
    after the last one (:meth:`_round`); checkpoints are taken only right after a round,
    when the replicas agree."""

    steps_apart = True

    def __init__(self, model: nn.Module, comm: Communicator, every: int) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm, self.every = comm, every
        self.rounds = 0
        self.last_sync = 0

    def after_step(self, done: int, last: bool) -> None:
        if done % self.every == 0 or last:
            self._round()
            self.rounds += 1
            self.last_sync = done

    def _round(self) -> None:
        raise TypeError(f"{type(self).__name__} must define _round")

    def at_boundary(self, done: int) -> bool:
        return done == self.last_sync

    def metrics(self) -> dict[str, Any]:
        return {"sync": self.name, "sync_rounds": self.rounds}


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
