"""Checks of a collective-based primitive run over groups of several sizes in one spawned
world of four ranks: the world, the pairs {0, 1} and {2, 3}, and singletons.

A test module declares ``CHECKS`` (name -> ``check(comm)``, asserting against a
single-process reference after every collective it issues, so a failing check does not
desync the ranks), then parametrises a test over the names and sizes and calls
:func:`assert_check_passed`. The world is spawned once per module and its results
cached.
"""

from __future__ import annotations

import functools
import importlib
import traceback
from collections.abc import Sequence

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.testing import run_distributed

WORLD = 4


def run_checks(module: str, sizes: Sequence[int], name: str) -> dict[str, str | None]:
    """On each rank: every check of ``module``'s ``CHECKS`` over a group of each size
    in ``sizes`` (communicators named ``name``): "check-size" -> a traceback or None."""
    import torch.distributed as dist

    checks = importlib.import_module(module).CHECKS
    rank, ledger = dist.get_rank(), CollectiveLedger()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    comms = {WORLD: Communicator(None, ledger, name=name),
             2: Communicator(pairs[rank // 2], ledger, name=name)}
    if 1 in sizes:
        singles = [dist.new_group([r]) for r in range(WORLD)]
        comms[1] = Communicator(singles[rank], ledger, name=name)
    out: dict[str, str | None] = {}
    for size in sizes:
        for check_name, check in checks.items():
            try:
                check(comms[size])
                out[f"{check_name}-{size}"] = None
            except AssertionError:
                out[f"{check_name}-{size}"] = traceback.format_exc()
    return out


@functools.cache
def _results(module: str, sizes: tuple[int, ...], name: str, timeout: float
             ) -> list | Exception:
    try:
        return run_distributed(run_checks, WORLD, args=(module, sizes, name),
                               timeout=timeout)
    except Exception as exc:  # cached, so one broken spawn is not repeated per check
        return exc


def assert_check_passed(module: str, check: str, size: int, sizes: Sequence[int],
                        name: str, timeout: float = 150) -> None:
    """``check`` over a group of ``size`` passed on every rank (the world of
    ``module``'s checks spawned on first use)."""
    results = _results(module, tuple(sizes), name, timeout)
    if isinstance(results, Exception):
        raise results
    key = f"{check}-{size}"
    failures = [f"rank {r}:\n{res[key]}" for r, res in enumerate(results) if res[key]]
    assert not failures, "\n".join(failures)
