"""Failure injection for the tests that prove crash safety.

``DISTTRAIN_FAULT=STAGE[:STEP][@RANK]`` makes the process exit at once (as a killed
process would, no clean-up) when it reaches ``STAGE`` — at ``STEP`` and on ``RANK`` if
given. Stages: ``train.step`` (after an optimizer step), ``save.before_tensors``,
``save.mid_file``, ``save.before_rename``, ``save.before_pointer``. Unset, it costs
one environment lookup. With ``DISTTRAIN_FAULT_REPLICA=I`` the fault strikes replica
group ``I`` only (``parallel.fault_tolerance``), on its first attempt, by SIGKILL.
With ``DISTTRAIN_FAULT_ONCE=1`` it strikes the first attempt only (torchrun's restarts
run clean: a restart from a checkpoint measured against fault tolerance).

``DISTTRAIN_SLOW=RANK:FACTOR`` makes a rank sleep, after its backward passes, for
``FACTOR - 1`` times its compute time: a worker ``FACTOR`` times slower, for straggler
and load balancing tests. ``DISTTRAIN_SAMPLE_COST=SECONDS`` makes every rank sleep, at
the same point, ``SECONDS`` per sample it trained in the step: a step cost that scales
with a rank's share of the batch without taking this machine's cores (what a device
does), for benchmarks whose figure is wall time.
"""

from __future__ import annotations

import os
import signal
import time

FAULT_ENV = "DISTTRAIN_FAULT"
FAULT_EXIT_CODE = 86
FAULT_REPLICA_ENV = "DISTTRAIN_FAULT_REPLICA"
FAULT_ONCE_ENV = "DISTTRAIN_FAULT_ONCE"


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
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if restarted and os.environ.get(FAULT_ONCE_ENV) == "1":
        return
    replica = os.environ.get(FAULT_REPLICA_ENV)
    if replica is not None:
        if replica != os.environ.get("DISTTRAIN_REPLICA_GROUP") or restarted:
            return
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(FAULT_EXIT_CODE)


SLOW_ENV = "DISTTRAIN_SLOW"
SAMPLE_COST_ENV = "DISTTRAIN_SAMPLE_COST"


def maybe_slow_down(rank: int, compute_s: float, samples: int = 0) -> None:
    per_sample = os.environ.get(SAMPLE_COST_ENV)
    if per_sample:
        time.sleep(float(per_sample) * samples)
    spec = os.environ.get(SLOW_ENV)
    if not spec:
        return
    on_rank, _, factor = spec.partition(":")
    if int(on_rank) == rank:
        time.sleep(max(float(factor) - 1.0, 0.0) * compute_s)
