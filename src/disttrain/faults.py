"""Failure injection for the tests that prove crash safety.

``DISTTRAIN_FAULT=STAGE[:STEP][@RANK]`` makes the process exit at once (as a killed
process would, no clean-up) when it reaches ``STAGE`` — at ``STEP`` and on ``RANK`` if
given. Stages: ``train.step`` (after an optimizer step), ``save.before_tensors``,
``save.mid_file``, ``save.before_rename``, ``save.before_pointer``. Unset, it costs
one environment lookup.

``DISTTRAIN_SLOW=RANK:FACTOR`` makes a rank sleep, after its backward passes, for
``FACTOR - 1`` times its compute time: a worker ``FACTOR`` times slower, for straggler
and load balancing tests.
"""

from __future__ import annotations

import os
import time

FAULT_ENV = "DISTTRAIN_FAULT"
FAULT_EXIT_CODE = 86


def maybe_fail(stage: str, rank: int, step: int | None = None) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    spec, _, on_rank = spec.partition("@")
    name, _, at_step = spec.partition(":")
    if name != stage or (on_rank and int(on_rank) != rank):
        return
    if at_step and (step is None or int(at_step) != step):
        return
    os._exit(FAULT_EXIT_CODE)


SLOW_ENV = "DISTTRAIN_SLOW"


def maybe_slow_down(rank: int, compute_s: float) -> None:
    spec = os.environ.get(SLOW_ENV)
    if not spec:
        return
    on_rank, _, factor = spec.partition(":")
    if int(on_rank) == rank:
        time.sleep(max(float(factor) - 1.0, 0.0) * compute_s)
