"""Stopping on SIGTERM / SIGINT at a step boundary that every rank agrees on.

The handler only records the signal; after each step the ranks take the largest
recorded signal number in one all-reduce of one integer, so a signal that reaches the
ranks at different moments still stops them all after the same step.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..comm import Communicator, ReduceOp

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalStop:
    """Records SIGTERM / SIGINT while :meth:`catching`; :meth:`agreed` says whether
    any rank got one."""

    def __init__(self, world: Communicator) -> None:
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
        flag = self.world.zeros(1, dtype=torch.int32)
        flag.fill_(self.received)
        self.world.all_reduce(flag, op=ReduceOp.MAX)
        return int(flag.item())
