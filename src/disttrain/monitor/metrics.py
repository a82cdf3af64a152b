"""Metric records: one JSON object per logged step in ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends records to ``run_dir/metrics.jsonl`` (rank 0 only; others pass None)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fh = path.open("a", encoding="utf-8") if path is not None else None

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record, sort_keys=True) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
