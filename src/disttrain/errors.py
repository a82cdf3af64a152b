"""Errors a user can act on.

Every exception derived from :class:`UserError` is reported by the command-line tool as
one line on stderr (what was wrong, the value, the fix) with exit code 2 and no
traceback. Anything else is a bug in disttrain and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path

EXIT_USAGE = 2


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
        super().__init__(128 + signum)
        self.signum = signum
