"""Metric records: one JSON object per logged step in ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .record import STEP, MetricsRecord, as_record


class MetricsWriter:
    """Appends records to ``run_dir/metrics.jsonl`` (rank 0 only; others pass None).
    The file is opened at the first record, after any truncation on resume.

    A write the filesystem refuses (a full disk, a quota) does not stop training: the
    bytes not yet written are kept in memory and retried with the next record, so the
    file never holds a partial line once writing works again; ``say`` reports the
    first failure and, at close, how many records were lost if the disk never
    recovered. Saving a checkpoint on that disk is what stops the run."""

    def __init__(self, path: Path | None, say: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.say = say or (lambda text: None)
        self._fd: int | None = None
        self._pending = b""
        self._unwritten = 0  # records with bytes in _pending
        self._partial = 0  # bytes of _pending's first record already in the file
        self._failing = False

    def write(self, record: MetricsRecord | Mapping[str, Any]) -> None:
        """Append ``record`` (a dict is checked against the record's fields first)."""
        if self.path is None:
            return
        line = json.dumps(finite_or_null(as_record(record).to_dict()), sort_keys=True,
                          allow_nan=False)
        self._pending += (line + "\n").encode("utf-8")
        self._unwritten += 1
        self._drain(self.path)

    def _drain(self, path: Path) -> None:
        """Write what is pending to ``path`` (this writer's :attr:`path`)."""
        try:
            if self._fd is None:
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            while self._pending:
                done = os.write(self._fd, self._pending)
                chunk, self._pending = self._pending[:done], self._pending[done:]
                self._unwritten -= chunk.count(b"\n")
                cut = chunk.rfind(b"\n")
                self._partial = done - cut - 1 if cut >= 0 else self._partial + done
        except OSError as exc:
            if not self._failing:
                self.say(f"warning: cannot write {self.path} ({exc.strerror or exc}); "
                         "keeping its records in memory and retrying at each log step")
            self._failing = True
            return
        if self._failing:
            self.say(f"{self.path} is writable again; the held records are written")
        self._failing = False

    def close(self) -> None:
        if self.path is not None and self._pending:
            self._drain(self.path)
            if self._pending:
                self.say(f"warning: {self._unwritten} metrics record(s) could not be "
                         f"written to {self.path}")
                if self._fd is not None and self._partial:  # no partial line is left
                    try:
                        os.ftruncate(self._fd, os.fstat(self._fd).st_size - self._partial)
                    except OSError:
                        pass
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def finite_or_null(value: Any) -> Any:
    """``value`` with every nan / inf float (in nested dicts and lists too) replaced by
    None, so that it is valid JSON (``null``): ``json.dumps`` would write ``NaN``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records as written, as dicts (older runs may hold keys no longer recorded).
    A line that is not a JSON object (cut short by a crash) is skipped."""
    records = []
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past ``last_step`` (a resumed run redoes those steps)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get(STEP, 0) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept),
                       encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
