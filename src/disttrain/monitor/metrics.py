"""Metric records: one JSON object per logged step in ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends records to ``run_dir/metrics.jsonl`` (rank 0 only; others pass None).
    The file is opened at the first record, after any truncation on resume."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fh = None

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._fh is None:
            self._fh = self.path.open("a", encoding="utf-8")
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past ``last_step`` (a resumed run redoes those steps)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept),
                   encoding="utf-8")
    tmp.replace(path)
