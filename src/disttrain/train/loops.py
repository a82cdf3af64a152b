"""The training loops: a step at a time, or the parameter server's own loop.

The composition says which one a run needs (``Parallelized.step``); both implement
:class:`TrainingLoop` and report a :class:`LoopResult`, from which the trainer writes
the summary. Each calls back into the trainer for what every run shares (evaluation,
the progress line, metrics records, checkpoints).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..errors import DivergenceError
from ..faults import maybe_fail
from ..monitor.record import MetricsRecord
from ..monitor.stats import StatsWindow, StepStats
from .optim import lr_at

if TYPE_CHECKING:
    from .trainer import Trainer


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


class TrainingLoop(Protocol):
    def run(self, trainer: Trainer) -> LoopResult: ...


class StepLoop:
    """``train.steps`` optimizer steps from ``trainer.start_step``; evaluation,
    checkpoints and metrics records at their cadences."""

    def run(self, trainer: Trainer) -> LoopResult:
        start = time.perf_counter()
        trainer.bar.status("first evaluation...")
        initial_eval = trainer.evaluate()
        trainer.callbacks.eval(trainer, trainer.start_step, initial_eval)
        trainer.bar.message(trainer.banner(initial_eval))
        totals = StatsWindow()
        recent: deque[float] = deque(maxlen=10)
        last_eval = initial_eval
        with trainer.signals.catching():
            last_eval = self._steps(trainer, totals, recent, last_eval)
        final_loss = sum(recent) / len(recent) if recent else float("nan")
        return LoopResult(initial_eval, last_eval, totals, final_loss,
                          time.perf_counter() - start)

    @staticmethod
    def _steps(trainer: Trainer, totals: StatsWindow, recent: deque[float],
               last_eval: float | None) -> float | None:
        """The steps. Each step's wall time runs from the end of the previous one's
        timing to the end of its own checkpoint work, less its evaluation: it holds the
        step, any wait for other ranks at the boundary, logging and saving."""
        train = trainer.config.train
        mark = time.perf_counter()
        for step in range(trainer.start_step, train.steps):
            stats = trainer.train_step(step)
            totals.add(stats)
            # a fedavg client that sat the step out has no loss; a skipped nan step none
            if stats.terms and math.isfinite(stats.loss):
                recent.append(stats.loss)
            done = step + 1
            evaluate_now = done % eval_interval(train.eval_every, train.steps,
                                                train.log_every) == 0
            evaluating = 0.0
            if evaluate_now or done == train.steps:
                started = time.perf_counter()
                last_eval = trainer.evaluate()
                trainer.callbacks.eval(trainer, done, last_eval)
                evaluating = time.perf_counter() - started
            trainer.maybe_checkpoint(done)
            maybe_fail("train.step", trainer.rank, done)
            now = time.perf_counter()
            for window in (totals, trainer.telemetry.window):
                window.add_wall(now - mark - evaluating)
            mark = now
            if done % train.log_every == 0 or done == train.steps or evaluate_now:
                trainer.log(done, last_eval if evaluate_now or done == train.steps
                            else None)
            if done < train.steps:  # a signal during the last step: the run completes
                trainer.stop_if_signalled(done)
        return last_eval


class ParameterServerLoop:
    """``train.sync=async``: parameter servers and workers run the server's loop
    (:meth:`~disttrain.parallel.sync.AsyncParameterServer.run`); no checkpoints."""

    def run(self, trainer: Trainer) -> LoopResult:
        train, b = trainer.config.train, trainer.plan.batch
        start = time.perf_counter()
        initial_eval = trainer.evaluate()
        trainer.callbacks.eval(trainer, 0, initial_eval)
        trainer.bar.message(trainer.banner(initial_eval))
        result = trainer.parallel.sync.run(
            optimizer=trainer.optimizer, steps=train.steps, sampler=trainer.sampler,
            per_worker=b.global_batch // b.dp, micro_batch=b.micro_batch,
            compute=trainer.stepper.gradients,
            lr_at=lambda s: lr_at(s, train, trainer.plan.lr),
            log=lambda record: self._log(trainer, record), log_every=train.log_every)
        if result["diverged"] is not None:  # every rank holds the same summary
            raise DivergenceError(*result["diverged"])
        if result["nonfinite_skipped"]:
            trainer.bar.message(f"{result['nonfinite_skipped']} push(es) with a non-finite "
                                "loss or gradient norm were skipped")
        trainer.position = result["samples"]
        totals = StatsWindow()
        totals.add(StepStats(terms=result["terms"], total_s=result["loop_s"]))
        totals.add_wall(result["loop_s"])
        final_eval = trainer.evaluate()
        trainer.callbacks.eval(trainer, train.steps, final_eval)
        return LoopResult(initial_eval, final_eval, totals, result["train_loss"],
                          time.perf_counter() - start)

    @staticmethod
    def _log(trainer: Trainer, record: MetricsRecord) -> None:
        """A record of the server's loop (no per-step point: on_step_end gets it too)."""
        trainer.bar.update(record.step, record.loss, lr=record.lr)
        trainer.telemetry.writer.write(record)
        trainer.callbacks.step_end(trainer, record)
        trainer.callbacks.log(trainer, record)
