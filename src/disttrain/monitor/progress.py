"""A live progress line on rank 0: step, loss, tokens/s, ETA.

On a terminal the line is redrawn in place; otherwise (CI, a log file) one line is
printed every ``every`` steps so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ProgressBar:
    """``enabled``: this rank speaks (rank 0); ``show_bar``: draw the step line too
    (messages such as the banner, warnings and the summary are shown either way)."""

    def __init__(self, total: int, *, enabled: bool, show_bar: bool = True, every: int = 10,
                 stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.enabled, self.every, self.width = total, enabled, every, width
        self.show_bar = enabled and show_bar
        self.stream = stream or sys.stderr
        self.tty = self.show_bar and self.stream.isatty()
        self.start = time.perf_counter()
        self.first_step: int | None = None
        self.unit = "tok"  # what the rate counts: tokens, or samples for mean losses

    def update(self, step: int, loss: float, rate: float) -> None:
        """``step`` is the number of steps done (1-based)."""
        if not self.show_bar:
            return
        if self.first_step is None:
            self.first_step, self.start = step - 1, time.perf_counter()
        if not self.tty and step % self.every and step != self.total:
            return
        done = step - self.first_step
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1) * (self.total - step)
        filled = int(self.width * step / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.4f} "
                f"| {rate:,.0f} {self.unit}/s | ETA {format_duration(eta)}")
        if self.tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                self.stream.write("\r\033[K")
            self.stream.write(text + "\n")
            self.stream.flush()
