"""What a run does when a step's loss or gradients come out nan / inf (``train.on_nonfinite``).

The step's update is never applied (it is skipped on the device, before the host knows).
Once the host has read the step's flags (one step late, or at once at a step where it
acts), under ``stop`` the run raises :class:`~disttrain.errors.DivergenceError` naming
that step (its last checkpoint stays the last finite one: a checkpoint is committed
only after its steps were seen finite); under ``skip`` it goes on and counts the skipped
steps. Every rank decides alike: where replicas share the step's totals they see the same
values; where they step apart (a sync mode's local steps), a MAX all-reduce of the two
flags on the device makes them agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from ..comm import Communicator, ReduceOp
from ..errors import DivergenceError

# torch's stubs type ReduceOp's members as ReduceOp.RedOpType; at run time they
# are ReduceOp instances, what Communicator.all_reduce takes
_MAX = cast(ReduceOp, ReduceOp.MAX)


class NonFinitePolicy:
    """``stops``: raise on a non-finite step (else skip it); ``apart``: replicas step on
    their own values, so a stop is agreed over ``world``; ``say``: the progress line."""

    def __init__(self, stops: bool, apart: bool, world: Communicator,
                 say: Callable[[str], None]) -> None:
        self.stops, self.world, self.say = stops, world, say
        self.agree = apart and stops  # whether agree_on runs every step

    def agree_on(self, flags: torch.Tensor) -> None:
        """``flags`` ([2] on the device: bad loss, bad gradients) become their maximum
        over every rank (every rank calls this at every step), not read here."""
        self.world.all_reduce(flags, op=_MAX)

    def after_step(self, done: int, what: str | None, skipped: int) -> None:
        """The host has read step ``done``'s flags: ``what`` went non-finite (None:
        nothing); ``skipped``: the steps skipped so far."""
        if what is None:
            return
        if self.stops:
            raise DivergenceError(done, what)
        self.say(f"step {done}: the {what} went non-finite; update skipped "
                 f"({skipped} skipped so far)")
