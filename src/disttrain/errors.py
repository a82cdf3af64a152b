"""Errors a user can act on.

Every exception derived from :class:`UserError` is reported by the command-line tool as
one line on stderr (what was wrong, the value, the fix) with exit code 2 and no
traceback. A run that stops on purpose (:class:`TrainingStopped`) is reported the same
way, with its own exit code. Anything else is a bug in disttrain and keeps its traceback.

Exit codes of ``disttrain train`` (and of a worker):

- 0: the run finished.
- 1: a failure that is not one of the below (a bug, a lost worker).
- 2 (:data:`EXIT_USAGE`): bad input, refused before training.
- 3 (:data:`EXIT_DIVERGED`): the loss or the gradients went non-finite with
  ``train.on_nonfinite = "stop"``; nothing was saved from the bad state.
- 4 (:data:`EXIT_SAVE_FAILED`): a checkpoint could not be written (disk full, ...); the
  previous checkpoint is untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_SAVE_FAILED = 4
# the codes a worker exits with on purpose; the launcher returns them unchanged
STOP_CODES = frozenset({EXIT_USAGE, EXIT_DIVERGED, EXIT_SAVE_FAILED})


class UserError(Exception):
    """Bad input from the user: a config value, a path, a flag. Exit code 2."""


class ConfigError(UserError):
    """A configuration field holds a value that cannot work.

    ``field`` is the dotted key (``train.lr``), ``value`` what was given and ``fix`` a
    sentence saying what to do instead.
    """

    def __init__(self, field: str, value: object, problem: str, fix: str = "") -> None:
        self.field, self.value, self.problem, self.fix = field, value, problem, fix
        msg = f"{field}={value!r}: {problem}"
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)


class InputErrors(UserError):
    """Several independent problems with the input, found in one pass: ``errors`` holds
    each one; the message has one line per error, so they can all be fixed at once."""

    def __init__(self, errors: list[UserError]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


class ErrorCollector:
    """Gathers the :class:`UserError` s raised inside :meth:`check` blocks, so a
    validation pass reports every problem instead of the first."""

    def __init__(self) -> None:
        self.errors: list[UserError] = []

    @contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except UserError as exc:
            self.errors.append(exc)

    def raise_any(self) -> None:
        """Raise nothing, the one error as it is, or all of them as :class:`InputErrors`."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise InputErrors(self.errors)


class DataError(UserError):
    """The data given cannot be used: a missing directory, no text files, too few tokens."""


class CheckpointRejected(UserError):
    """A checkpoint file that cannot be trusted: ``path`` and ``reason`` (one line)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = Path(path), " ".join(reason.split())
        super().__init__(f"{path}: {self.reason}")


class Interrupted(SystemExit):
    """The run stopped on a signal (after saving, under ``checkpoint.on_signal=save``).

    A ``SystemExit`` with the shell's code for the signal (128 + its number: 143 for
    SIGTERM, 130 for SIGINT), so a script calling ``Trainer.fit`` exits with it too.
    """

    def __init__(self, signum: int) -> None:
        self.exit_code = 128 + signum  # SystemExit's ``code``, typed as an int
        super().__init__(self.exit_code)
        self.signum = signum


class TrainingStopped(Exception):
    """Training stopped on purpose, every rank agreeing; ``exit_code`` says why. The
    message is one line for the user."""

    exit_code = 1


class DivergenceError(TrainingStopped):
    """What step ``step`` (1-based) computed is not finite: ``what`` is ``"loss"``,
    ``"gradients"``, ``"loss and gradients"``, or the state a checkpoint would hold."""

    exit_code = EXIT_DIVERGED

    def __init__(self, step: int, what: str) -> None:
        self.step, self.what = step, what
        super().__init__(f"training diverged at step {step}: the {what} went non-finite "
                         "(nan or inf); nothing was saved from that state (lower "
                         "train.lr, set train.grad_clip, or set train.on_nonfinite=skip "
                         "to skip such steps)")


class TensorParallelGradientError(TrainingStopped):
    """At the first step, a parameter every tp rank should compute alike got different
    gradients on different tp ranks: the model's tensor-parallel plan misclassifies it
    (e.g. a per-head norm declared replicated). Stopped before any update; refused input,
    so exit 2."""

    exit_code = EXIT_USAGE


class CheckpointSaveError(TrainingStopped):
    """A checkpoint could not be written; its staging directory was removed and the
    previous checkpoint is untouched."""

    exit_code = EXIT_SAVE_FAILED


def nonfinite_what(bad_loss: bool, bad_grads: bool, loss_scaled: bool) -> str | None:
    """What went nan / inf in a step (None: nothing), from its two flags: the loss total
    (summed over the ranks whose gradients are summed together, so a nan or inf
    anywhere makes it non-finite) and the global gradient norm. Every rank that shares
    gradients holds the same flags. With fp16 loss scaling a gradient overflow is the
    scaler's to skip, not a divergence."""
    bad_grads = bad_grads and not loss_scaled
    if bad_loss and bad_grads:
        return "loss and gradients"
    return "loss" if bad_loss else "gradients" if bad_grads else None
