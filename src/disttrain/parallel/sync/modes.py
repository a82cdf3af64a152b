"""What every synchronisation mode shares: the trainer's hooks (:class:`EveryStep`, which
is ``every_step`` itself) and the round counting of the periodic modes
(:class:`PeriodicSync`).

A mode implements :class:`~..interfaces.SyncStrategy`; the loop calls it at fixed points:

- ``select`` - which dataset indices this rank trains on in a step (fedavg swaps in
  its client's partition, or None when the client sits out a round);
- ``after_step`` - after every optimizer step (rounds end here);
- ``at_boundary`` - whether replicas agree now (checkpoints wait for it);
- ``restart`` - after a checkpoint replaced the parameters (resume);
- ``metrics`` - fields added to metrics records and the summary.

``every_step``: gradients are all-reduced inside each step by
:class:`~disttrain.parallel.ddp.DataParallel`, so there is nothing to do in between.
The other modes step on :class:`~.local.LocalGradients` (no communication inside a
step)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...comm.collectives import Communicator
from ...names import SYNC_EVERY_STEP


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
