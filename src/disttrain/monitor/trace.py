"""A timeline of every rank in Chrome-trace JSON (opens in Perfetto / chrome://tracing).

Each rank records complete events ("ph": "X") with wall-clock microseconds, so ranks on
one host line up; ``pid`` is the rank (one track per rank), ``tid`` names the lane
(main thread, communication, checkpoint). Rank 0 merges the per-rank files at the end.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..comm.spans import now_us

LANES = {"main": 0, "comm": 1, "checkpoint": 2, "pipeline": 3}


class Tracer:
    """Records spans when ``enabled``; otherwise every call is a cheap no-op.

    Satisfies :class:`disttrain.comm.spans.SpanRecorder`, so comm can record its
    collectives here without importing monitor.
    """

    def __init__(self, enabled: bool, rank: int) -> None:
        self.enabled, self.rank = enabled, rank
        self.events: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def span(self, name: str, lane: str = "main", **args: Any) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = now_us()
        try:
            yield
        finally:
            self.complete(name, start, now_us(), lane, **args)

    def complete(self, name: str, start_us: float, end_us: float, lane: str = "main",
                 **args: Any) -> None:
        if self.enabled:  # list.append is atomic: safe from communication threads
            self.events.append({"name": name, "ph": "X", "ts": start_us,
                                "dur": max(end_us - start_us, 0.0), "pid": self.rank,
                                "tid": LANES.get(lane, len(LANES)), "args": args})

    def write(self, path: Path) -> None:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": lane}} for lane, tid in LANES.items()]
        path.write_text(json.dumps(meta + self.events))


def merge_traces(parts: list[Path], out: Path) -> Path:
    """One trace file from the per-rank files (which are removed)."""
    events: list[dict[str, Any]] = []
    for part in parts:
        events += json.loads(part.read_text())
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    for part in parts:
        part.unlink()
    return out
