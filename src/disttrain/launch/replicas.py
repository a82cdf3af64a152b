"""Starting a fault-tolerant job on one machine: torchft's lighthouse and
``parallel.replicas`` replica groups, each a torchrun group of its own (its own
rendezvous, its own ``--max-restarts``), told its index (``DISTTRAIN_REPLICA_GROUP``)
and the lighthouse's address (``TORCHFT_LIGHTHOUSE``).

A group that fails is restarted by its own agent and heals from a live peer; the
others keep stepping. When every group fails at once, each restarts from its own last
checkpoint (``RUN_DIR/replica-I``) and the quorum brings them to the furthest one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace

from ..names import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from .agent import PASSED_ON_CODES, LaunchOptions, torchrun_args


def replica_dir(run_dir: str, group: int) -> str:
    """Where replica group ``group`` writes (its checkpoints, metrics, summary)."""
    return os.path.join(run_dir, f"replica-{group}")


def start_lighthouse(heartbeat_s: float, min_replicas: int = 1) -> object:
    """torchft's lighthouse on a free port of this machine (``.address()``, ``.shutdown()``).

    A replica group without a heartbeat for ``heartbeat_s`` leaves the quorum, and a
    quorum waits as long for a heartbeating group that has not asked to join yet (one
    still starting, or slowed by a loaded machine): both are ``parallel.ft_heartbeat_s``.
    Leaving early costs a heal, never a wrong step (torchft's step count decides who
    heals; a lone group cannot form a quorum while the others heartbeat)."""
    from torchft.coordination import LighthouseServer

    ms = int(heartbeat_s * 1000)
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=ms,
                            heartbeat_timeout_ms=ms)


def launch_replicas(opts: LaunchOptions, replicas: int, lighthouse: str,
                    target_for: Callable[[int], list[str]], heartbeat_s: float) -> int:
    """Run ``replicas`` groups of ``opts.nproc // replicas`` workers, group ``i`` on
    ``target_for(i)``, joined by the lighthouse at ``lighthouse`` (empty: one started
    here, with ``heartbeat_s``: :func:`start_lighthouse`). Returns 0 when every group
    finished, the groups' common code when they stopped on purpose with the same one
    (2: bad input, ...), else 1."""
    group = replace(opts, nproc=opts.nproc // replicas)
    server = None
    if not lighthouse:
        server = start_lighthouse(heartbeat_s)
        lighthouse = server.address()  # type: ignore[attr-defined]
    procs = []
    try:
        for i in range(replicas):
            env = {**os.environ, REPLICA_GROUP_ENV: str(i), LIGHTHOUSE_ENV: lighthouse}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run",
                 *torchrun_args(group, target_for(i))], env=env))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
    failed = {c for c in codes if c != 0}
    if not failed:
        return 0
    if len(failed) == 1 and failed <= set(PASSED_ON_CODES):
        return failed.pop()
    print(f"disttrain: replica group exit codes {codes}", file=sys.stderr)
    return 1
