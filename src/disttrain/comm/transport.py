"""The transport's own threads, kept off the cores the ranks compute on.

Gloo's TCP transport drives its sockets from one thread per device (named
``gloo_tcp_loop``), which keeps polling, busy, for a while after each message. Where
the ranks' compute threads fill the host's cores (a CPU run of one rank per core),
that thread takes its share of a core from the compute beside it: on the 2-core
development VM, measured with ``/proc`` thread accounting, about 1 ms of CPU per small
all-reduce, and a tiny GPT's per-rank compute at world 2 ran at about half the speed
of the same work at world 1 (``bench/README.md``, the planner section).

:func:`yield_to_compute` lowers those threads to the lowest priority (nice 19); a run
that computes on the CPU calls it (a GPU run's Gloo groups carry control messages only,
beside compute that is not on the host, and stay as torch made them): a
core nobody computes on still runs them at full speed, and while a rank waits in a
collective its compute thread sleeps and leaves them the core; they only stop
taking time from compute. The lowest nice value, not ``SCHED_IDLE``, so that a
machine busy with other work still gives them a small share and never starves a
collective. Linux only (elsewhere it changes nothing).
``DISTTRAIN_TRANSPORT_PRIORITY=keep`` leaves the threads as torch made them (to compare,
as ``bench/transport_threads.py`` does, or where a machine's cores are to spare).
"""

from __future__ import annotations

import os

from ..errors import UserError
from ..names import TRANSPORT_PRIORITIES, TRANSPORT_PRIORITY_ENV

_POLLERS = frozenset({"gloo_tcp_loop"})
_LOWEST = 19


def transport_priority() -> str:
    """``low`` or ``keep``, from ``DISTTRAIN_TRANSPORT_PRIORITY`` (unset: ``low``); any
    other value is refused."""
    value = os.environ.get(TRANSPORT_PRIORITY_ENV, "").strip() or TRANSPORT_PRIORITIES[0]
    if value not in TRANSPORT_PRIORITIES:
        raise UserError(f"{TRANSPORT_PRIORITY_ENV}={value!r}: expected one of "
                        f"{', '.join(TRANSPORT_PRIORITIES)} (low: the transport's polling "
                        "threads yield the cores to compute; keep: as torch made them)")
    return value


def yield_to_compute() -> int:
    """Lower this process's transport-polling threads to nice 19; the number of
    threads changed (0 where none runs, all are already low, ``keep`` is asked for, or
    not on Linux). Threads a process group creates later are not seen: call again
    after creating groups."""
    tasks = "/proc/self/task"
    if transport_priority() == "keep" or not hasattr(os, "setpriority") \
            or not os.path.isdir(tasks):
        return 0
    changed = 0
    for entry in os.listdir(tasks):
        try:
            with open(f"{tasks}/{entry}/comm") as f:
                if f.read().strip() not in _POLLERS:
                    continue
            tid = int(entry)
            if os.getpriority(os.PRIO_PROCESS, tid) < _LOWEST:
                os.setpriority(os.PRIO_PROCESS, tid, _LOWEST)
                changed += 1
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return changed
