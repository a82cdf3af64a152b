"""Callbacks: user code the :class:`~disttrain.Trainer` calls at the points of a run.

    class LossPrinter(disttrain.Callback):
        def on_step_end(self, trainer, record):
            print(record.step, record.loss)

    disttrain.Trainer(model, data, loss_fn, config, callbacks=[LossPrinter()]).fit()

Each point is a method of :class:`Callback`. They run on rank 0 only (unless
``all_ranks``) and outside every collective, so no rank waits on another's callback; a
callback that raises is reported once and not called again. ``docs/monitoring.md``,
"Logging and callbacks", says when each point comes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from ..config import Config
from .record import MetricsRecord


class Trainer(Protocol):
    """What a callback is handed: the :class:`~disttrain.Trainer` running the fit
    (declared here, below the trainer's package; it has more than these)."""

    config: Config
    model: nn.Module

    @property
    def run_dir(self) -> Path | None: ...

    @property
    def start_step(self) -> int: ...  # 0, or the step a resumed run continues from

    @property
    def rank(self) -> int: ...

    @property
    def is_main(self) -> bool: ...


class Callback:
    """Base of every callback: override the points you need, each a no-op until then.
    Callbacks must not issue collectives; one that raises gets no further calls but
    :meth:`on_train_end`, and the run goes on."""

    all_ranks: bool = False  # True: called on every rank, not only rank 0

    def on_train_start(self, trainer: Trainer) -> None:
        """Once, after the run is built (process groups, model, run directory; a resumed
        run's checkpoint loaded) and before the first step; ``trainer.start_step`` says
        where it starts."""
        pass

    def on_step_end(self, trainer: Trainer, record: MetricsRecord) -> None:
        """After every optimizer step, with a light record: ``step`` (1-based), ``lr``,
        ``loss`` (the step's, over the global batch; None for a step this rank sat out),
        ``grad_norm``, ``samples_seen``. Under ``train.sync=async`` (no per-step point)
        at the logged steps, with their records."""
        pass

    def on_log(self, trainer: Trainer, record: MetricsRecord) -> None:
        """At every logged step (``train.log_every``, each evaluation, the last step),
        with the full record written to ``metrics.jsonl`` (what the metrics loggers
        write)."""
        pass

    def on_eval(self, trainer: Trainer, step: int, eval_loss: float) -> None:
        """After each held-out evaluation (``step`` is ``start_step`` for the one
        before training)."""
        pass

    def on_checkpoint(self, trainer: Trainer, step: int, path: Path) -> None:
        """Once the checkpoint of ``step`` is committed to the directory ``path`` (an
        asynchronous save: at the first step boundary after every rank has written its
        part, or at the end)."""
        pass

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any] | None) -> None:
        """Once at the end: ``summary`` is what :meth:`~disttrain.Trainer.fit` returns,
        or None when the run stopped early (an error, a signal). Close here what the
        callback opened."""
        pass


class Callbacks:
    """The callbacks this rank calls, each guarded: a failure disables that one."""

    def __init__(self, callbacks: Sequence[Callback], is_main: bool,
                 say: Callable[[str], None], rank: int = 0) -> None:
        self.active = [c for c in callbacks if is_main or c.all_ranks]
        self.disabled: list[Callback] = []
        self.say = say if is_main else _to_stderr(rank)
        self.ended = False

    def train_start(self, trainer: Trainer) -> None:
        self._each("on_train_start", lambda c: c.on_train_start(trainer))

    def step_end(self, trainer: Trainer, record: MetricsRecord) -> None:
        self._each("on_step_end", lambda c: c.on_step_end(trainer, record))

    def log(self, trainer: Trainer, record: MetricsRecord) -> None:
        self._each("on_log", lambda c: c.on_log(trainer, record))

    def eval(self, trainer: Trainer, step: int, eval_loss: float | None) -> None:
        if eval_loss is not None:
            self._each("on_eval", lambda c: c.on_eval(trainer, step, eval_loss))

    def checkpoint(self, trainer: Trainer, step: int, path: Path) -> None:
        self._each("on_checkpoint", lambda c: c.on_checkpoint(trainer, step, path))

    def train_end(self, trainer: Trainer, summary: dict[str, Any] | None) -> None:
        """Once per run (later calls do nothing); disabled callbacks get it too, so
        they can close what they opened."""
        if self.ended:
            return
        self.ended = True
        everyone, self.disabled = self.active + self.disabled, []
        self.active = everyone
        self._each("on_train_end", lambda c: c.on_train_end(trainer, summary))

    def _each(self, point: str, call: Callable[[Callback], None]) -> None:
        for callback in list(self.active):
            try:
                call(callback)
            except Exception as exc:  # a user's bug must not stop (or hang) the run
                self.active.remove(callback)
                self.disabled.append(callback)
                self.say(f"warning: callback {type(callback).__name__}.{point} raised "
                         f"{type(exc).__name__}: {exc}; it gets no further calls")


def _to_stderr(rank: int) -> Callable[[str], None]:
    return lambda text: print(f"rank {rank}: {text}", file=sys.stderr, flush=True)
