"""One owner per run directory: an exclusive ``fcntl.flock`` on :data:`OWNER_FILE`.

Two runs writing one directory interleave their metrics and overwrite each other's
checkpoints, so the second run is refused (exit 2) naming the owner's pid and host.
Who locks: the launcher (``disttrain train``) for a single-node job, and passes
ownership to its workers through :data:`RUN_DIR_OWNED_ENV`; otherwise (``Trainer.fit``
used directly, ``torchrun``, multi-node jobs, whose launchers on several hosts would
refuse each other) rank 0 of the job. The lock goes with the process (its file
descriptor), so a crashed owner never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError
from ..names import OWNER_FILE, RUN_DIR_OWNED_ENV


class RunDirBusy(UserError):
    """Another live process owns the run directory."""


class RunDirLock:
    """Holds ``run_dir``'s lock from construction until :meth:`release`."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / OWNER_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 256).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            pid, _, host = owner.partition(" ")
            raise RunDirBusy(f"run directory {str(run_dir)!r} is in use by pid {pid} on "
                             f"host {host or '?'} (wait for that run to finish, or give "
                             "another --run-dir)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self.fd: int | None = fd

    def forget_in_child(self) -> None:
        """In a process forked from the owner (a loader worker): close this process's
        copy of the descriptor, so the lock goes with the owner alone (a crashed
        owner's workers, still alive for a moment, must not hold it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def owned_by_launcher(run_dir: Path) -> bool:
    """True in a worker whose launcher already holds ``run_dir``'s lock."""
    owned = os.environ.get(RUN_DIR_OWNED_ENV)
    if not owned:
        return False
    return Path(owned).resolve() == run_dir.resolve()


@contextmanager
def owned_for_workers(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock while the workers this process starts meanwhile run;
    they learn from :data:`RUN_DIR_OWNED_ENV` that their launcher holds it."""
    lock = RunDirLock(run_dir)
    os.environ[RUN_DIR_OWNED_ENV] = str(run_dir.resolve())
    try:
        yield
    finally:
        os.environ.pop(RUN_DIR_OWNED_ENV, None)
        lock.release()
