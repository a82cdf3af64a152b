"""Local SGD: each dp rank steps on its own gradient; parameters are averaged over dp
every ``sync_every`` steps and after the last step.

With plain SGD (no momentum) and H = 1 this is exactly every_step: the average of
``x - lr g_r`` over ranks is ``x - lr mean_r g_r``. Each rank keeps its own optimizer
state (momentum, Adam moments); only parameters are averaged, in one all-reduce of the
flat fp32 parameter vector [numel + 1] per round.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...comm.collectives import Communicator
from .base import SyncStrategy, weighted_average


class LocalSGD(SyncStrategy):
    """Parameter averaging every ``every`` steps over ``comm`` (the dp group)."""

    name = "local_sgd"
    local_gradients = True

    def __init__(self, model: nn.Module, comm: Communicator, every: int) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm, self.every = comm, every
        self.rounds = 0
        self.last_sync = 0

    def after_step(self, done: int, last: bool) -> None:
        if done % self.every == 0 or last:
            weighted_average(self.comm, self.params, 1.0)
            self.rounds += 1
            self.last_sync = done

    def at_boundary(self, done: int) -> bool:
        return done == self.last_sync

    def metrics(self) -> dict[str, Any]:
        return {"sync": self.name, "sync_rounds": self.rounds}
