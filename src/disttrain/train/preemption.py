"""Stopping on SIGTERM / SIGINT at a step boundary that every rank agrees on.

The handler only records the signal; after each step the ranks take the largest
recorded signal number in one all-reduce of one integer, so a signal that reaches the
ranks at different moments still stops them all after the same step. That all-reduce
runs on a CPU (Gloo) group: on a GPU, an all-reduce on the device group read back by
the host would wait for the step's queued work every step, and the GPU would then idle
while the host prepared the next one.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import torch

from ..comm import Communicator, ReduceOp

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# torch's stubs type ReduceOp's members as ReduceOp.RedOpType; at run time they
# are ReduceOp instances, what Communicator.all_reduce takes
_MAX = cast(ReduceOp, ReduceOp.MAX)


class SignalStop:
    """Records SIGTERM / SIGINT while :meth:`catching`; :meth:`agreed` says whether
    any rank got one. ``world``: a communicator over every rank on the CPU (Gloo)."""

    def __init__(self, world: Communicator) -> None:
        if world.device.type != "cpu":
            raise ValueError(f"SignalStop agrees over a CPU group; {world.name!r} is on "
                             f"{world.device}")
        self.world = world
        self.received = 0  # the signal number this rank got, 0 for none

    @contextmanager
    def catching(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _record(self, signum: int, _frame: object) -> None:
        self.received = max(self.received, signum)

    def agreed(self) -> int:
        """The largest signal number any rank received (0: none); a collective."""
        if self.world.size == 1:
            return self.received
        flag = self.world.zeros(1, dtype=torch.int32)
        flag.fill_(self.received)
        self.world.all_reduce(flag, op=_MAX)
        return int(flag.item())
