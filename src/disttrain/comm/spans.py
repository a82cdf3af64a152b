"""What comm needs from a timeline: a clock and somewhere to record finished spans.

comm times its collectives (launch to completion) but must not depend on the monitor
that draws the timeline, since monitor's watchdog and telemetry sit on top of comm.
:class:`SpanRecorder` declares the one role comm uses; ``monitor.trace.Tracer``
satisfies it structurally. :func:`now_us` is the single time base: spans measured here
and spans measured by the recorder itself must line up on one axis.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


def now_us() -> float:
    """Wall-clock microseconds (not monotonic: ranks on one host must line up)."""
    return time.time_ns() / 1000.0


class SpanRecorder(Protocol):
    """Records a completed span; ``enabled`` False means every call may be skipped."""

    enabled: bool

    def complete(self, name: str, start_us: float, end_us: float, lane: str = "main",
                 **args: Any) -> None:
        """Record ``name`` on ``lane`` from ``start_us`` to ``end_us`` (:func:`now_us`).
        Called from communication threads too, so it must be thread-safe."""
        ...
