"""A run directory as the report reads it: its records, summary and config."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import UserError
from ...names import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from ..record import STEP

Record = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class RunData:
    """What a report is made of: the run's records in step order, its summary ({} when
    the run has not finished) and its config text (None when absent)."""

    run_dir: Path
    records: list[Record]
    summary: dict[str, Any] = field(default_factory=dict)
    config_text: str | None = None


def load_run(run_dir: Path) -> RunData:
    """Read a run directory; a UserError (with the fix) when it cannot make a report."""
    if not run_dir.is_dir():
        raise UserError(f"run directory {str(run_dir)!r} does not exist (give the directory "
                        "a `disttrain train` run wrote, e.g. runs/<time>)")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{str(run_dir)!r} has no {METRICS_FILE} (give a run directory "
                        "written by `disttrain train` or disttrain.Trainer, after its first "
                        "logged step)")
    records = _read_records(path)
    if not records:
        raise UserError(f"{str(path)!r} holds no records (the run has not logged a step "
                        "yet; wait for train.log_every steps)")
    summary_path, config_path = run_dir / SUMMARY_FILE, run_dir / CONFIG_FILE
    summary = _read_json(summary_path) if summary_path.is_file() else {}
    config = config_path.read_text(encoding="utf-8") if config_path.is_file() else None
    return RunData(run_dir=run_dir, records=records, summary=summary, config_text=config)


def _read_records(path: Path) -> list[Record]:
    """Records with a step, sorted by step. A torn last line (a run killed while
    writing) is dropped; a bad line anywhere else is an error."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise UserError(f"{str(path)!r} line {i + 1} is not JSON ({exc.msg}; remove "
                            "or repair that line)") from None
        if isinstance(record, dict) and number(record.get(STEP)) is not None:
            records.append(record)
    return sorted(records, key=lambda r: r[STEP])


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} is not JSON ({exc.msg}; delete it to report "
                        "without a summary)") from None
    return value if isinstance(value, dict) else {}


def number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number, else None (NaN and inf, which
    json writes for a diverged loss, are not plotted)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def series(records: list[Record], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that hold a number under ``key``."""
    pairs = [(float(r[STEP]), number(r.get(key))) for r in records]
    kept = [(s, v) for s, v in pairs if v is not None]
    return [s for s, _ in kept], [v for _, v in kept]
