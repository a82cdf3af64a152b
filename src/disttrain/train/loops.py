"""The training loops: a step at a time, or the loop a sync mode runs itself.

Both implement :class:`TrainingLoop` over a :class:`LoopHost` (what every run shares:
evaluation, the banner, steps, metrics records, checkpoints; a
:class:`~disttrain.train.run.Run` is one) and report a :class:`LoopResult`, from which
the run writes the summary.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from ..config.schema import TrainConfig
from ..errors import DivergenceError
from ..monitor.stats import StatsWindow, StepStats
from ..parallel.interfaces import OwnLoopInputs, RunsOwnLoop


@dataclass
class LoopResult:
    initial_eval: float | None
    final_eval: float | None
    totals: StatsWindow
    final_loss: float
    wall_time: float


# train.eval_every = 0: about this many held-out evaluations in a run (after the one
# before the first step), so the held-out curve has points, not just its two ends
AUTO_EVALUATIONS = 10


def eval_interval(eval_every: int, steps: int, log_every: int) -> int:
    """Steps between held-out evaluations: ``eval_every``, or for 0 the smallest
    multiple of ``log_every`` at least ``steps / AUTO_EVALUATIONS`` (so evaluations
    fall on logged steps and add no records)."""
    if eval_every > 0:
        return eval_every
    target = max(1, steps // AUTO_EVALUATIONS)
    return log_every * math.ceil(target / log_every)


class LoopHost(Protocol):
    """What a loop uses of the run it drives."""

    start_step: int

    @property
    def train(self) -> TrainConfig:
        """The run's training settings (read-only: a loop never replaces them)."""

    def evaluate(self, step: int) -> float | None:
        """The held-out loss (None without held-out data), told to the callbacks as
        step ``step``'s."""

    def status(self, text: str) -> None:
        """A transient status on the progress line."""

    def announce(self, initial_eval: float | None) -> None:
        """The start-up banner."""

    def catching_signals(self) -> AbstractContextManager[None]:
        """SIGTERM / SIGINT noted, not raised, while the steps run."""

    def train_step(self, step: int) -> StepStats:
        """Optimizer step ``step`` (0-based) and the sync mode's work after it."""

    def add_wall(self, seconds: float) -> None:
        """A step's wall time, for the metrics window."""

    def after_step(self, done: int) -> None:
        """A checkpoint if due, then a fault if one is injected for step ``done``."""

    def log(self, step: int, eval_loss: float | None) -> None:
        """A metrics record for step ``step`` (a collective)."""

    def stop_if_signalled(self, done: int) -> None:
        """Save and stop if any rank got a signal."""

    def own_loop_inputs(self) -> OwnLoopInputs:
        """What a sync mode running its own loop is handed."""

    def own_loop_done(self, samples: int, skipped: int) -> None:
        """Such a loop consumed ``samples``; ``skipped`` pushes were non-finite."""


class TrainingLoop(Protocol):
    def run(self, host: LoopHost) -> LoopResult: ...


class StepLoop:
    """``train.steps`` optimizer steps from ``host.start_step``; evaluation,
    checkpoints and metrics records at their cadences."""

    def run(self, host: LoopHost) -> LoopResult:
        start = time.perf_counter()
        host.status("first evaluation...")
        initial_eval = host.evaluate(host.start_step)
        host.announce(initial_eval)
        totals = StatsWindow()
        recent: deque[float] = deque(maxlen=10)
        with host.catching_signals():
            last_eval = self._steps(host, totals, recent, initial_eval)
        final_loss = sum(recent) / len(recent) if recent else float("nan")
        return LoopResult(initial_eval, last_eval, totals, final_loss,
                          time.perf_counter() - start)

    @staticmethod
    def _steps(host: LoopHost, totals: StatsWindow, recent: deque[float],
               last_eval: float | None) -> float | None:
        """The steps. Each step's wall time runs from the end of the previous one's
        timing to the end of its own checkpoint work, less its evaluation: it holds the
        step, any wait for other ranks at the boundary, logging and saving."""
        train = host.train
        mark = time.perf_counter()
        for step in range(host.start_step, train.steps):
            stats = host.train_step(step)
            totals.add(stats)
            # a rank that sat the step out has no loss; a skipped nan step none
            if stats.terms and math.isfinite(stats.loss):
                recent.append(stats.loss)
            done = step + 1
            evaluate_now = done % eval_interval(train.eval_every, train.steps,
                                                train.log_every) == 0
            evaluating = 0.0
            if evaluate_now or done == train.steps:
                started = time.perf_counter()
                last_eval = host.evaluate(done)
                evaluating = time.perf_counter() - started
            host.after_step(done)
            now = time.perf_counter()
            totals.add_wall(now - mark - evaluating)
            host.add_wall(now - mark - evaluating)
            mark = now
            if done % train.log_every == 0 or done == train.steps or evaluate_now:
                host.log(done, last_eval if evaluate_now or done == train.steps else None)
            if done < train.steps:  # a signal during the last step: the run completes
                host.stop_if_signalled(done)
        return last_eval


class OwnLoop:
    """The loop of a sync mode that runs its own (:class:`RunsOwnLoop`: parameter
    servers and workers); held-out evaluations at its start and end, no checkpoints."""

    def __init__(self, mode: RunsOwnLoop) -> None:
        self.mode = mode

    def run(self, host: LoopHost) -> LoopResult:
        start = time.perf_counter()
        initial_eval = host.evaluate(0)
        host.announce(initial_eval)
        result = self.mode.run_loop(host.own_loop_inputs())
        if result.diverged is not None:  # every rank holds the same result
            raise DivergenceError(*result.diverged)
        host.own_loop_done(result.samples, result.nonfinite_skipped)
        totals = StatsWindow()
        totals.add(StepStats(terms=result.terms, total_s=result.loop_s))
        totals.add_wall(result.loop_s)
        final_eval = host.evaluate(host.train.steps)
        return LoopResult(initial_eval, final_eval, totals, result.train_loss,
                          time.perf_counter() - start)
