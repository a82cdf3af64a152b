"""When a run saves: every ``checkpoint.every`` steps at a point where the replicas agree,
and on SIGTERM / SIGINT at the first such point after every rank saw the signal.

A finished asynchronous save is collected at each step boundary (a failed one stops
training there) and announced to the callbacks once every rank's part is written.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from ..errors import Interrupted
from ..parallel.interfaces import StepTracer, SyncStrategy
from .checkpointing import RunCheckpoints
from .preemption import SignalStop


class CheckpointCadence:
    """``checkpoints`` saved at their cadence and on a signal (``save_on_signal``:
    ``checkpoint.on_signal=save``) when ``sync`` says replicas agree; ``announce(step,
    path)``: tell the callbacks of a committed checkpoint; ``say``: the progress line."""

    def __init__(self, checkpoints: RunCheckpoints, signals: SignalStop,
                 sync: SyncStrategy, tracer: StepTracer, save_on_signal: bool,
                 announce: Callable[[int, Path], None], say: Callable[[str], None]) -> None:
        self.checkpoints, self.signals, self.sync = checkpoints, signals, sync
        self.tracer, self.save_on_signal = tracer, save_on_signal
        self.announce, self.say = announce, say
        self.stopping = 0  # the signal every rank agreed to stop on (0: none)

    def after_step(self, done: int, position: int) -> None:
        """Save after step ``done`` if it is due and the replicas agree (first, collect
        a finished asynchronous save: a failed one stops training here)."""
        self.checkpoints.check()
        if self.checkpoints.due(done) and self.sync.at_boundary(done):
            with self.tracer.span("checkpoint"):
                self.checkpoints.save(done, position)
        self.announce_completed()

    def announce_completed(self) -> None:
        """Tell the callbacks of each checkpoint committed since the last call."""
        for step in self.checkpoints.take_completed():
            self.announce(step, self.checkpoints.directory(step))

    def signalled(self, done: int) -> bool:
        """After step ``done``: whether the run stops here on a signal (a collective,
        on the CPU group). Once any rank got SIGTERM / SIGINT, that is the first step
        where a save is valid (unless ``checkpoint.on_signal=exit``: at once)."""
        self.stopping = self.stopping or self.signals.agreed()
        save = self.save_on_signal
        return bool(self.stopping) and not (save and not self.sync.at_boundary(done))

    def stop(self, done: int, position: int) -> None:
        """Save after step ``done`` (unless ``checkpoint.on_signal=exit``), then raise
        :class:`~disttrain.errors.Interrupted` on every rank; only after
        :meth:`signalled` said so."""
        save = self.save_on_signal
        if save and self.checkpoints.last_saved != done:
            with self.tracer.span("checkpoint"):
                self.checkpoints.save(done, position)
        self.checkpoints.close()  # an async save is complete before the exit
        what = "checkpoint saved" if save else "not saved (checkpoint.on_signal=exit)"
        name = signal.Signals(self.stopping).name
        self.announce_completed()
        self.say(f"stopped by {name} after step {done}; {what}")
        raise Interrupted(self.stopping)

    def close(self) -> None:
        """The last save complete (an asynchronous one too), then announced."""
        self.checkpoints.close()
        self.announce_completed()
