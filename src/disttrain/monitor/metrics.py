"""Metric records: one JSON object per logged step in ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .record import STEP, MetricsRecord, as_record


class MetricsWriter:
    """Appends records to ``run_dir/metrics.jsonl`` (rank 0 only; others pass None).
    The file is opened at the first record, after any truncation on resume."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fh = None

    def write(self, record: MetricsRecord | Mapping[str, Any]) -> None:
        """Append ``record`` (a dict is checked against the record's fields first)."""
        if self.path is None:
            return
        line = json.dumps(finite_or_null(as_record(record).to_dict()), sort_keys=True,
                          allow_nan=False)
        if self._fh is None:
            self._fh = self.path.open("a", encoding="utf-8")
        self._fh.write(line + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


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
    """The records as written, as dicts (older runs may hold keys no longer recorded)."""
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past ``last_step`` (a resumed run redoes those steps)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get(STEP, 0) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept),
                   encoding="utf-8")
    tmp.replace(path)
