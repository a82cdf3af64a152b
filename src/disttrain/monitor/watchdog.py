"""Hang diagnostics: name the rank and the collective instead of freezing.

Every collective goes through a Communicator, which records it in the rank's
:class:`~disttrain.comm.CollectiveLedger` and marks when the rank blocks on one. The
:class:`HangWatchdog` thread looks at that mark once a second. When a wait passes
``hang_timeout``, the rank publishes where it is (the collective it waits at and the
last one it issued) in the job's rendezvous store, gives the other ranks a few seconds
to do the same, and the lowest reporting rank prints the picture, e.g.

    hang: rank 1 waits at all_gather #12 (tests/x.py:40) while rank 0 waits at
    all_reduce #12 (comm/buckets.py:97)

then every reporting rank exits with :data:`HANG_EXIT_CODE`, so the launcher tears the
job down (or restarts it) instead of waiting forever.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ..comm.collectives import CollectiveLedger, CollectiveRecord

HANG_EXIT_CODE = 75
_KEY = "disttrain/hang/"
_ALARM = "disttrain/hang/alarm"


def _describe(rec: CollectiveRecord | None) -> str:
    return "nothing" if rec is None else rec.describe()


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    parts, start = [], None
    ranks = sorted(ranks)
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def diagnose(reports: dict[int, dict], world_size: int) -> str:
    """One line: which ranks wait where; ranks that did not report are named too."""
    # ((verb for one rank, for several), where) -> the ranks
    groups: dict[tuple[tuple[str, str], str], list[int]] = {}
    for rank, rep in reports.items():
        where = (("waits", "wait"), f"at {rep['waiting']}") if rep.get("waiting") else \
            (("is", "are"), f"not in a collective (last issued {rep['last']})")
        groups.setdefault(where, []).append(rank)
    # the odd one out first: the smallest group is the likely culprit
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
    text = " while ".join(f"{_ranges(r)} {verb[len(r) > 1]} {where}"
                          for (verb, where), r in ordered)
    silent = sorted(set(range(world_size)) - set(reports))
    if silent:
        text += (f"; {_ranges(silent)} did not report (busy outside any collective, "
                 "or dead)")
    return "hang: " + text


class HangWatchdog:
    """A daemon thread per rank; :meth:`stop` ends it."""

    def __init__(self, ledger: CollectiveLedger, store: dist.Store, rank: int,
                 world_size: int, timeout_s: float, grace_s: float = 5.0,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        self.ledger, self.store = ledger, store
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.grace_s, self.exit_fn = timeout_s, grace_s, exit_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="disttrain-watchdog",
                                        daemon=True)

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and wait for it: a daemon thread still inside a store call
        when the interpreter exits is torn down mid-call, which aborts the process
        ("terminate called without an active exception") after a finished run."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            rec, since = self.ledger.waiting, self.ledger.waiting_since
            if rec is not None and time.monotonic() - since > self.timeout_s:
                self.store.set(_ALARM, str(self.rank))
                self._report(rec)
                return
            if self.store.check([_ALARM]):  # another rank found a hang: say where we are
                self._report(rec)
                return

    def _report(self, waiting: CollectiveRecord | None) -> None:
        mine = {"waiting": waiting.describe() if waiting else None,
                "last": _describe(self.ledger.last())}
        self.store.set(f"{_KEY}{self.rank}", json.dumps(mine))
        time.sleep(self.grace_s)  # let the others notice and report too
        reports = self._read_reports()
        if reports and self.rank == min(reports):
            print(f"disttrain: {diagnose(reports, self.world_size)} "
                  f"(no progress for {self.timeout_s:.0f}s; [monitor] hang_timeout)",
                  file=sys.stderr, flush=True)
        time.sleep(1.0)  # the store may live in a rank's process: let the others read
        self.exit_fn(HANG_EXIT_CODE)

    def _read_reports(self) -> dict[int, dict]:
        reports: dict[int, dict] = {}
        try:
            for r in range(self.world_size):
                key = f"{_KEY}{r}"
                if self.store.check([key]):
                    reports[r] = json.loads(self.store.get(key))
        except (RuntimeError, OSError):  # the store went away with its host rank
            pass
        return reports


def default_store() -> dist.Store | None:
    """The store the default process group was made with (None for a world of one)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None
