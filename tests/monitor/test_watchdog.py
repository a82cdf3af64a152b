"""Hang diagnostics: a skipped collective is named, with the rank, in bounded time."""

from __future__ import annotations

import time

import pytest
import torch

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.monitor.watchdog import HANG_EXIT_CODE, HangWatchdog, default_store, diagnose
from disttrain.testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

HANG_TIMEOUT = 4.0


def _rank_skips_an_all_reduce(skipper: int) -> None:
    import torch.distributed as dist

    ledger = CollectiveLedger()
    comm = Communicator(None, ledger)
    HangWatchdog(ledger, default_store(), dist.get_rank(), dist.get_world_size(),
                 timeout_s=HANG_TIMEOUT, grace_s=2.0).start()
    comm.all_reduce(torch.ones(3))
    if dist.get_rank() == skipper:
        comm.all_gather(torch.ones(2))       # skipped the all-reduce: now out of step
    else:
        comm.all_reduce(torch.ones(3))
    comm.barrier()


@pytest.mark.parametrize("world_size,skipper", [(2, 1), (4, 3)])
def test_skipped_collective_is_named_and_the_job_exits(world_size, skipper, capfd):
    start = time.monotonic()
    # the reporting ranks exit with HANG_EXIT_CODE; a peer may notice that first
    died = f"exit code {HANG_EXIT_CODE}|Connection closed|Connection reset"
    with pytest.raises(DistributedTestError, match=died):
        run_distributed(_rank_skips_an_all_reduce, world_size, args=(skipper,),
                        timeout=HANG_TIMEOUT + 40)
    assert time.monotonic() - start < HANG_TIMEOUT + 15 + 10  # + process start-up
    err = capfd.readouterr().err
    line = next(ln for ln in err.splitlines() if "hang:" in ln)
    assert f"rank {skipper} waits at all_gather #2 (monitor/test_watchdog.py:" in line
    others = "rank 0 waits" if world_size == 2 else "ranks 0-2 wait"
    assert f"{others} at all_reduce #2 (monitor/test_watchdog.py:" in line


def test_diagnose_names_silent_ranks_and_orders_the_odd_one_first():
    reports = {0: {"waiting": "all_reduce #9 (a.py:1)", "last": "x"},
               1: {"waiting": "all_reduce #9 (a.py:1)", "last": "x"},
               2: {"waiting": None, "last": "broadcast #8 (b.py:2)"}}
    text = diagnose(reports, world_size=4)
    assert text == ("hang: rank 2 is not in a collective (last issued broadcast #8 (b.py:2))"
                    " while ranks 0-1 wait at all_reduce #9 (a.py:1); rank 3 did not "
                    "report (busy outside any collective, or dead)")
