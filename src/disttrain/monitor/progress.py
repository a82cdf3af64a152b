"""What rank 0 shows while training: a status line per start-up phase, then progress.

On a terminal, a ``tqdm`` bar redrawn in place and fitted to the terminal's width (it
shrinks the bar, then trims, as the window narrows): steps, elapsed and remaining time,
step/s, then loss, learning rate and a smoothed throughput. Start-up phases (building
the data cache, starting the workers, the first evaluation) show as a transient status
line that the next one replaces. Elsewhere (CI, a log file) nothing is redrawn and no
status line is written: one plain line every ``every`` steps, and at the last step::

    step 20/100 | loss 3.2104 | lr 3.00e-04 | 12,345 tok/s | 2.10 step/s | 00:10 elapsed | ETA 00:38

Throughput, step/s and the ETA are measured over the last :data:`WINDOW` updates, so
one slow step (an evaluation, a checkpoint) does not swing them; until two steps have
been timed the ETA reads ``--:--``.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any, TextIO

WINDOW = 20  # updates the rates are measured over


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def status(text: str, stream: TextIO | None = None) -> None:
    """A transient status line on a terminal (the next output replaces it); nothing
    elsewhere, so logs and one-line errors stay as they are."""
    stream = stream or sys.stderr
    if _isatty(stream):
        stream.write(f"\r\033[K{text}")
        stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream
        return False


class ProgressBar:
    """``enabled``: this rank speaks (rank 0); ``show_bar``: draw the progress too
    (messages such as the banner, warnings and the summary are shown either way)."""

    def __init__(self, total: int, *, enabled: bool, show_bar: bool = True, every: int = 10,
                 stream: TextIO | None = None, tty: bool | None = None,
                 width: int | None = None) -> None:
        self.total, self.enabled, self.every = total, enabled, every
        self.show_bar = enabled and show_bar
        self.stream = stream or sys.stderr
        self.tty = enabled and (_isatty(self.stream) if tty is None else tty)
        self.unit = "tok"  # what the rate counts: tokens, or samples for mean losses
        self.width = width  # columns on a terminal (None: the terminal's, as it changes)
        self.start: float | None = None  # the wall time the first update measures from
        self.first_step = 0
        self._times: deque[tuple[int, float, float]] = deque(maxlen=WINDOW + 1)
        self._terms = 0.0
        self._bar: Any = None  # the tqdm bar, made at the first update on a terminal
        self._status = False  # a transient status line is showing

    # ----------------------------------------------------------------- phases
    def status(self, text: str) -> None:
        """A start-up phase (terminal only, replaced by what comes next)."""
        if self.tty and self._bar is None:
            self.stream.write(f"\r\033[K{text}")
            self.stream.flush()
            self._status = True

    def message(self, text: str) -> None:
        """A line kept in the output (the banner, a warning, the summary)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.clear()
        elif self._status:
            self.stream.write("\r\033[K")
            self._status = False
        self.stream.write(text + "\n")
        self.stream.flush()
        if self._bar is not None:
            self._bar.refresh()

    # ----------------------------------------------------------------- progress
    def update(self, step: int, loss: float, terms: float = 0.0, seconds: float = 0.0,
               lr: float | None = None) -> None:
        """Step ``step`` (1-based, steps done) finished with ``loss``, having processed
        ``terms`` tokens (or samples) in ``seconds`` of its own."""
        if not self.show_bar:
            return
        now = time.perf_counter()
        if self.start is None:
            self.start, self.first_step = now - seconds, step - 1
            self._times.append((step - 1, self._terms, self.start))
        self._terms += terms
        self._times.append((step, self._terms, now))
        if self.tty:
            self._draw(step, loss, lr)
        elif step % self.every == 0 or step == self.total:
            self.stream.write(self.line(step, loss, lr) + "\n")
            self.stream.flush()

    def rates(self) -> tuple[float, float]:
        """(terms/s, steps/s) over the last :data:`WINDOW` updates (0 before any)."""
        (s0, n0, t0), (s1, n1, t1) = self._times[0], self._times[-1]
        span = max(t1 - t0, 1e-9)
        return (n1 - n0) / span, (s1 - s0) / span if s1 > s0 else 0.0

    def eta(self, step: int) -> float | None:
        """Seconds left at the recent step rate; None until two steps were timed."""
        if len(self._times) < 3:
            return None
        _, per_s = self.rates()
        return (self.total - step) / per_s if per_s > 0 else None

    def line(self, step: int, loss: float, lr: float | None) -> str:
        """The plain progress line."""
        rate, per_s = self.rates()
        eta = self.eta(step)
        elapsed = time.perf_counter() - (self.start or time.perf_counter())
        parts = [f"step {step:>{len(str(self.total))}}/{self.total}", f"loss {loss:.4f}"]
        if lr is not None:
            parts.append(f"lr {lr:.2e}")
        if self._terms:  # an async server's records count no tokens
            parts.append(f"{rate:,.0f} {self.unit}/s")
        parts += [f"{per_s:.2f} step/s",
                  f"{format_duration(elapsed)} elapsed",
                  f"ETA {'--:--' if eta is None else format_duration(eta)}"]
        return " | ".join(parts)

    def _draw(self, step: int, loss: float, lr: float | None) -> None:
        if self._bar is None:
            from tqdm import tqdm

            if self._status:
                self.stream.write("\r\033[K")
                self._status = False
            self._bar = tqdm(total=self.total, initial=self.first_step, file=self.stream,
                             dynamic_ncols=self.width is None, ncols=self.width,
                             unit="step", leave=True, smoothing=0.1,
                             mininterval=0.25, ascii=not _utf8(self.stream),
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} "
                                        "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
            # elapsed counts from the first step's start, not from this first draw
            self._bar.start_t -= time.perf_counter() - (self.start or time.perf_counter())
        rate, _ = self.rates()
        postfix = f"loss {loss:.4f}" + (f" lr {lr:.1e}" if lr is not None else "")
        if self._terms:
            postfix += f" {_short(rate)} {self.unit}/s"
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._status:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._status = False


def _short(rate: float) -> str:
    """12,345 -> 12.3k: short enough for a narrow terminal."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if rate >= limit:
            return f"{rate / limit:.1f}{suffix}"
    return f"{rate:.0f}"


def _utf8(stream: TextIO) -> bool:
    return "utf" in (getattr(stream, "encoding", None) or "").lower()
