"""The run directory: config snapshot, metrics, summary (the final weights:
:mod:`.final_weights`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import EXIT_USAGE, TrainingStopped, UserError
from ..monitor.metrics import finite_or_null
from ..names import STOPPED_FILE, SUMMARY_FILE


def new_run_dir_name() -> Path:
    """``runs/<time>`` (torchrun's run id makes it unique per elastic job)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    suffix = f"-{run_id[:8]}" if run_id and run_id != "none" else ""
    return Path("runs") / f"{stamp}{suffix}"


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary file: ``path`` is either the old file
    or the new one; the temporary file does not outlive a failed write."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The run's stored summary; {} when there is none or it cannot be read."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    write_text_atomic(run_dir / SUMMARY_FILE, json.dumps(finite_or_null(summary), indent=2,
                                                         sort_keys=True, allow_nan=False))


# --------------------------------------------------------------------- restarts
# torch's elastic agent restarts the workers after any failure (--max-restarts). A run
# that stopped on purpose (diverged, a failed save, refused input) would only do the
# same again, so its rank 0 leaves STOPPED_FILE, and a restarted attempt that finds it
# stops at once with the same exit code. The first attempt of a launch removes it.
# Both ways of starting a worker (disttrain train, a script calling Trainer.fit under
# torchrun) go through stops_once.

@contextmanager
def stops_once(run_dir: Path | None) -> Iterator[None]:
    """Around one attempt of a worker: an attempt after one that stopped on purpose
    stops at once with its exit code; a stop on purpose inside (TrainingStopped,
    UserError) is recorded by rank 0 when torchrun may restart the workers. Nothing
    without a run directory. Nested uses agree (they write the same record)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    restartable = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > attempt
    main = os.environ.get("RANK", "0") == "0"
    if run_dir is not None and attempt > 0:
        code = earlier_stop(run_dir)
        if code is not None:
            stop = TrainingStopped(f"not restarting (restart {attempt}): an earlier "
                                   f"attempt stopped on purpose (exit {code}, said above) "
                                   "and would again")
            stop.exit_code = code
            if not main:  # rank 0 says it: leaving first could get it stopped unheard;
                time.sleep(60.0)  # the agent stops this worker as soon as rank 0 exits
            raise stop
    elif run_dir is not None and main:
        forget_stop(run_dir)
    try:
        yield
    except (TrainingStopped, UserError) as exc:
        code = exc.exit_code if isinstance(exc, TrainingStopped) else EXIT_USAGE
        if run_dir is not None and main and restartable and run_dir.is_dir():
            record_stop(run_dir, code, str(exc))
        raise


def record_stop(run_dir: Path, code: int, message: str) -> None:
    """Rank 0 of a worker group that may be restarted: why it stopped (best effort)."""
    try:
        write_text_atomic(run_dir / STOPPED_FILE, json.dumps({"exit_code": code,
                                                               "message": message}))
    except OSError:
        pass


def earlier_stop(run_dir: Path) -> int | None:
    """The exit code a previous attempt of this launch stopped with on purpose."""
    try:
        code = json.loads((run_dir / STOPPED_FILE).read_text(encoding="utf-8"))["exit_code"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, int) and 0 < code < 126 else None


def forget_stop(run_dir: Path) -> None:
    (run_dir / STOPPED_FILE).unlink(missing_ok=True)
