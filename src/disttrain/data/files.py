"""Where a corpus's files are, shared by both preparers (text files, :mod:`.corpus`;
pre-tokenized shards, :mod:`.pretokenized`): the files a glob pattern matches, which
of them the held-out split takes, the directory prepared corpora are cached in, and the
lock that lets one of many ranks prepare while the others wait."""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_cache_dir() -> Path:
    """``$DISTTRAIN_CACHE`` if set, else ``~/.cache/disttrain``."""
    env = os.environ.get("DISTTRAIN_CACHE", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "disttrain"


def matching_files(root: Path, pattern: str) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every regular file matching ``pattern``, sorted."""
    pat = tuple(p for p in pattern.split("/") if p not in ("", "."))
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root).parts
        for name in filenames:
            if _glob_match(rel_dir + (name,), pat):
                path = Path(dirpath, name)
                if path.is_file():
                    found.append(("/".join(rel_dir + (name,)), path))
    return sorted(found)


def _glob_match(parts: tuple[str, ...], pat: tuple[str, ...]) -> bool:
    """``pathlib`` glob semantics: ``**`` spans zero or more directories."""
    if not pat:
        return not parts
    if pat[0] == "**":
        return any(_glob_match(parts[i:], pat[1:]) for i in range(len(parts) + 1))
    return (bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0])
            and _glob_match(parts[1:], pat[1:]))


def in_val(rel: str, val_fraction: float) -> bool:
    """Whether the file at relative posix path ``rel`` is held out: the first 32 bits
    of its sha256, read as a fraction of 2**32, fall below ``val_fraction``."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) inside the block."""
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
