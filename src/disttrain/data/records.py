"""Where instruction and chat examples come from (``data.format = "jsonl"``): JSON-lines
files, or a Hugging Face ``datasets`` dataset written by ``save_to_disk``.

``data.path`` is one ``.jsonl`` file, a directory whose files matching ``data.pattern``
and ending in ``.jsonl`` are read in sorted order, or a ``save_to_disk`` directory (it
holds ``dataset_info.json`` or ``dataset_dict.json``; every split of a ``DatasetDict`` is
read, in its own order). Each example comes with its location, ``FILE:LINE`` (1-based)
or ``DIR[split] row N``, which every error about it names.

The input is untrusted: a line is read up to :data:`MAX_LINE_BYTES` and no further, a
line that is not UTF-8 JSON or not a JSON object is reported as a problem at its
location (never an exception from deep inside a parser); blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.data.files import matching_files
from disttrain.errors import DataError

SUFFIX = ".jsonl"
MAX_LINE_BYTES = 16 << 20  # one example; far above any seq_len's worth of text
# what save_to_disk writes at the top of its directory (a Dataset, a DatasetDict)
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Problem:
    """Why an example cannot be used, and what to do about it (one line each)."""

    problem: str
    fix: str

    def at(self, where: str) -> str:
        return f"{where}: {self.problem} ({self.fix})"


@dataclass(frozen=True)
class Record:
    """One example as read: its location and its JSON object, or the problem with it."""

    where: str
    value: dict[str, Any] | Problem


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in DATASET_MARKERS)


def source_files(path: Path, pattern: str) -> list[tuple[str, Path]]:
    """(relative path, path) of every file the examples are read from, sorted: the
    ``.jsonl`` file itself, the ``.jsonl`` files under a directory, or every file of a
    saved dataset (its cache key's input)."""
    if path.is_file():
        return [(path.name, path)]
    if is_saved_dataset(path):
        return matching_files(path, "**/*")
    found = [(rel, p) for rel, p in matching_files(path, pattern) if p.suffix == SUFFIX]
    if not found:
        raise DataError(f"data.path={str(path)!r} data.pattern={pattern!r}: no {SUFFIX} "
                        "file matched and it is not a saved datasets dataset (point "
                        "data.path at a .jsonl file, a directory of them, or a "
                        "save_to_disk directory)")
    return found


def read_records(path: Path, pattern: str) -> Iterator[Record]:
    """Every example under ``path`` (see the module docstring), in a fixed order."""
    if is_saved_dataset(path):
        yield from _dataset_records(path)
        return
    for _, file in source_files(path, pattern):
        yield from _jsonl_records(file)


def _jsonl_records(file: Path) -> Iterator[Record]:
    with open(file, "rb") as f:
        number = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            number += 1
            where = f"{file}:{number}"
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # the rest of the long line
                    line = f.readline(MAX_LINE_BYTES)
                yield Record(where, Problem(f"the line is longer than {MAX_LINE_BYTES >> 20} "
                                            "MiB", "split the example or shorten it"))
                continue
            if line.strip():
                yield Record(where, _parse(line))


def _parse(line: bytes) -> dict[str, Any] | Problem:
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return Problem("the line is not UTF-8 text", "write the file as UTF-8")
    except json.JSONDecodeError as exc:
        return Problem(f"not valid JSON ({exc.msg} at column {exc.colno})",
                       "write one JSON object per line")
    except RecursionError:
        return Problem("JSON nested too deeply", "write one flat JSON object per line")
    if not isinstance(value, dict):
        return Problem(f"a JSON {type(value).__name__}, not an object",
                       'write one object per line: {"prompt": ..., "completion": ...} or '
                       '{"messages": [...]}')
    return value


def _dataset_records(path: Path) -> Iterator[Record]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # the library's own error types: one line
        raise DataError(f"data.path={str(path)!r}: cannot be read as a saved datasets "
                        f"dataset ({' '.join(str(exc).split())}) (write it with "
                        "Dataset.save_to_disk, or give .jsonl files)") from None
    splits = ([(None, loaded)] if isinstance(loaded, datasets.Dataset)
              else sorted(loaded.items()))
    for split, dataset in splits:
        name = str(path) if split is None else f"{path}[{split}]"
        for number, row in enumerate(dataset.with_format(None)):
            yield Record(f"{name} row {number}",
                         {k: v for k, v in row.items() if v is not None})
