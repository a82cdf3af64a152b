"""What a run does when a step's loss or gradients come out nan / inf (``train.on_nonfinite``).

The step's update is never applied. Under ``stop`` the run raises
:class:`~disttrain.errors.DivergenceError` (its last checkpoint stays the last finite
one); under ``skip`` it goes on and counts the skipped steps. Every rank decides alike:
where replicas share the step's totals they see the same values; where they step apart
(a sync mode's local steps), one all-reduce of two flags makes them agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from ..comm import Communicator, ReduceOp
from ..errors import DivergenceError

# torch's stubs type ReduceOp's members as ReduceOp.RedOpType; at run time they
# are ReduceOp instances, what Communicator.all_reduce takes
_MAX = cast(ReduceOp, ReduceOp.MAX)


class NonFinitePolicy:
    """``stops``: raise on a non-finite step (else skip it); ``apart``: replicas step on
    their own values, so they agree first over ``world``; ``say``: the progress line."""

    def __init__(self, stops: bool, apart: bool, world: Communicator,
                 say: Callable[[str], None]) -> None:
        self.stops, self.apart, self.world, self.say = stops, apart, world, say

    def after_step(self, done: int, mine: str | None, skipped: int) -> None:
        """Step ``done`` saw ``mine`` go non-finite on this rank (None: nothing);
        ``skipped``: the steps skipped so far."""
        what = self._agreed(mine) if self.apart and self.stops else mine
        if what is None:
            return
        if self.stops:
            raise DivergenceError(done, what)
        self.say(f"step {done}: the {what} went non-finite; update skipped "
                 f"({skipped} skipped so far)")

    def _agreed(self, mine: str | None) -> str | None:
        """What went non-finite on any rank (replicas that step apart share no loss
        total): one all-reduce of two flags, loss and gradients."""
        flags = self.world.zeros(2)
        flags[0] = float(mine is not None and "loss" in mine)
        flags[1] = float(mine is not None and "gradients" in mine)
        self.world.all_reduce(flags, op=_MAX)
        loss, grads = flags.tolist()
        return ("loss and gradients" if loss and grads else "loss" if loss
                else "gradients" if grads else None)
