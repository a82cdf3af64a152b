"""DiLoCo: ``sync_every`` inner steps of the local optimizer (AdamW), then one outer
step shared by all dp ranks.

Each rank keeps the *global* parameters of the round's start, ``theta`` [numel] (fp32,
flat). At the round's end:

    delta   = theta - local parameters          (this rank's pseudo-gradient, [numel])
    delta   = mean over dp of delta             (one all-reduce of [numel])
    buf     = outer_momentum * buf + delta      (buf = delta on the first round)
    theta  -= outer_lr * (delta + outer_momentum * buf)     (Nesterov)

and every rank copies ``theta`` into its model, so replicas agree after each round. The
outer step is ``torch.optim.SGD(nesterov=True)`` on ``theta`` (plain momentum SGD when
outer_momentum is 0). Inner optimizer states stay per rank across rounds.

With a ``codec`` (``comm.codec``) the pseudo-gradient's all-reduce goes through it
(:func:`~disttrain.comm.codecs.reduce_flat`, one segment per parameter, key
``"diloco"``), so bytes per round shrink by the codec's ratio; a biased codec's error
feedback carries what a round did not send into the next round's pseudo-gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...comm.codecs import GradientCodec
from ...comm.collectives import Communicator
from ...names import SYNC_DILOCO
from .modes import PeriodicSync
from .vectors import flatten, unflatten_into


class OuterNesterov:
    """The outer optimizer over the flat global parameters ``theta`` [numel]."""

    def __init__(self, theta: torch.Tensor, lr: float, momentum: float) -> None:
        self.theta = nn.Parameter(theta, requires_grad=False)
        self.optimizer = torch.optim.SGD([self.theta], lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)

    def step(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """Apply one outer step with ``pseudo_grad`` [numel]; returns the new theta."""
        self.theta.grad = pseudo_grad
        self.optimizer.step()
        self.theta.grad = None
        return self.theta.detach()


def outer_round(comm: Communicator, params: Sequence[torch.Tensor],
                outer: OuterNesterov, codec: GradientCodec | None = None) -> None:
    """End one round: average the pseudo-gradients over ``comm`` (through ``codec``
    when given), take the outer step, and load the new global parameters into
    ``params`` on every rank."""
    delta = outer.theta.detach() - flatten(params)
    if codec is None:
        comm.all_reduce(delta)
    else:
        codec.all_reduce(delta, comm, key=SYNC_DILOCO, segments=[p.shape for p in params])
    delta /= comm.size
    unflatten_into(outer.step(delta), params)


class DiLoCo(PeriodicSync):
    """Inner steps on local gradients; an outer Nesterov step every ``every`` steps."""

    name = SYNC_DILOCO

    def __init__(self, model: nn.Module, comm: Communicator, every: int, outer_lr: float,
                 outer_momentum: float, codec: GradientCodec | None = None) -> None:
        super().__init__(model, comm, every)
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.outer = OuterNesterov(flatten(self.params), outer_lr, outer_momentum)
        self.codec = codec

    def restart(self) -> None:
        """The next round starts from the parameters now in the model (a checkpoint
        replaced them); the outer momentum, which checkpoints do not hold, starts over."""
        self.outer = OuterNesterov(flatten(self.params), self.outer_lr, self.outer_momentum)

    def _round(self) -> None:
        outer_round(self.comm, self.params, self.outer, self.codec)
