"""Durable file writes: data fsync'd, and the directory entry too; the mode of new files."""

from __future__ import annotations

import os
from pathlib import Path


def new_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the umask. For files
    made by a library that creates them 0600 (safetensors), so every output of a run
    has the same permissions."""
    try:  # Linux: read without changing it (another thread may be creating files)
        with open("/proc/self/status", encoding="ascii") as fh:
            umask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, payload: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
