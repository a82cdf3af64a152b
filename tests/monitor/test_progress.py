"""What rank 0 prints while training: plain lines off a terminal, a bar that fits the
terminal on one, transient status lines only on a terminal."""

from __future__ import annotations

import io
import re

from disttrain.monitor.progress import ProgressBar, status

PLAIN = re.compile(r"^step +(\d+)/40 \| loss (\d+\.\d{4}) \| lr (\S+) \| ([\d,]+) tok/s \| "
                   r"(\d+\.\d\d) step/s \| (\d\d:\d\d) elapsed \| ETA (\d\d:\d\d|--:--)$")


class _Clock:
    def __init__(self, monkeypatch) -> None:
        import disttrain.monitor.progress as progress

        self.now = 100.0
        monkeypatch.setattr(progress.time, "perf_counter", lambda: self.now)


def test_off_a_terminal_one_line_per_interval_with_rate_and_eta(monkeypatch):
    clock, out = _Clock(monkeypatch), io.StringIO()
    bar = ProgressBar(40, enabled=True, every=10, stream=out, tty=False)
    bar.status("first evaluation...")  # not on a terminal: nothing
    for step in range(1, 41):
        seconds = 0.5 if step != 5 else 5.0  # one slow step (an evaluation)
        clock.now += seconds
        bar.update(step, 4.0 - step / 100, terms=1000, seconds=seconds, lr=3e-4)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [int(PLAIN.match(line).group(1)) for line in lines] == [10, 20, 30, 40]
    step20 = PLAIN.match(lines[1])
    assert step20.group(2) == "3.8000" and step20.group(3) == "3.00e-04"
    # the rates cover the last 20 steps: 20 x 1000 tokens in 14.5 s (one 5 s step)
    assert step20.group(4) == f"{20_000 / 14.5:,.0f}"
    assert step20.group(7) == "00:14"  # 20 steps left at 20 / 14.5 step/s
    last = PLAIN.match(lines[3])  # steps 21-40, all 0.5 s: 2 step/s, 2,000 tok/s
    assert last.group(4) == "2,000" and last.group(5) == "2.00" and last.group(7) == "00:00"


def test_the_eta_waits_for_two_timed_steps(monkeypatch):
    clock, out = _Clock(monkeypatch), io.StringIO()
    bar = ProgressBar(10, enabled=True, every=1, stream=out, tty=False)
    clock.now += 1.0
    bar.update(1, 2.0, terms=10, seconds=1.0)
    assert out.getvalue().rstrip().endswith("ETA --:--")


def test_a_resumed_run_counts_only_its_own_steps(monkeypatch):
    clock, out = _Clock(monkeypatch), io.StringIO()
    bar = ProgressBar(30, enabled=True, every=5, stream=out, tty=False)
    for step in range(21, 31):
        clock.now += 1.0
        bar.update(step, 1.0, terms=100, seconds=1.0)
    assert "step 25/30" in out.getvalue() and "ETA 00:05" in out.getvalue()


def test_on_a_terminal_the_bar_fits_the_width_and_keeps_messages(monkeypatch):
    clock, out = _Clock(monkeypatch), io.StringIO()
    bar = ProgressBar(1000, enabled=True, stream=out, tty=True, width=80)
    bar.status("starting 2 worker(s)...")
    for step in range(1, 6):
        clock.now += 0.3
        bar.update(step, 3.14159, terms=123_456, seconds=0.3, lr=1e-3)
        if step == 3:
            bar.message("straggler: rank 1 is 2.0x slower")
    bar.close()
    text = out.getvalue()
    assert "starting 2 worker(s)..." in text
    assert "straggler: rank 1 is 2.0x slower\n" in text
    drawn = [part for line in text.split("\n") for part in line.split("\r") if part]
    assert any("loss 3.1416" in p and "lr 1.0e-03" in p and "k tok/s" in p for p in drawn)
    assert max(len(re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", p)) for p in drawn) <= 80


def test_a_silent_rank_and_quiet_runs_print_no_progress():
    out = io.StringIO()
    ProgressBar(10, enabled=False, stream=out, tty=True).update(1, 1.0, 1, 1.0)
    quiet = ProgressBar(10, enabled=True, show_bar=False, every=1, stream=out, tty=False)
    quiet.update(1, 1.0, 1, 1.0)
    quiet.message("done")
    assert out.getvalue() == "done\n"


def test_status_lines_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    plain, tty = io.StringIO(), Tty()
    status("preparing the data...", plain)
    status("preparing the data...", tty)
    assert plain.getvalue() == "" and tty.getvalue() == "\r\x1b[Kpreparing the data..."
