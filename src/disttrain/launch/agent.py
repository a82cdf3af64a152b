"""Starting workers through torch's elastic agent (the code behind ``torchrun``).

``disttrain train`` and ``disttrain run`` build a torchrun argument list and hand it to
``torch.distributed.run``; a single node uses ``--standalone`` (a free local port), more
nodes use the c10d rendezvous at ``--rdzv-endpoint``. Workers learn they are workers
from the environment torchrun sets (:func:`inside_worker`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
from dataclasses import dataclass

from ..errors import STOP_CODES, UserError
from ..monitor.watchdog import HANG_EXIT_CODE
from .allocator import allocator_env


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    nproc: int = 2
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str = ""
    rdzv_id: str = "disttrain"  # the CLI passes default_rdzv_id(run directory)
    rdzv_conf: str = ""
    local_addr: str = ""
    max_restarts: int = 0

    def node_counts(self) -> range:
        """Every number of nodes the job may run with (``MIN:MAX`` for elastic jobs)."""
        lo, _, hi = self.nnodes.partition(":")
        try:
            low, high = int(lo), int(hi or lo)
        except ValueError:
            raise UserError(f"--nnodes {self.nnodes!r}: expected N or MIN:MAX "
                            "(e.g. --nnodes 2 or --nnodes 1:4)") from None
        if not 1 <= low <= high:
            raise UserError(f"--nnodes {self.nnodes!r}: need 1 <= MIN <= MAX")
        return range(low, high + 1)

    def world_sizes(self) -> list[int]:
        self.check_nproc()
        return [self.nproc * n for n in self.node_counts()]

    def check_nproc(self) -> None:
        if self.nproc < 1:
            raise UserError(f"--nproc {self.nproc}: need at least one process per node")


def default_rdzv_id(job: str) -> str:
    """A rendezvous id derived from what names the job (its run directory's absolute
    path): the same on every node given that path, different for another job."""
    return "disttrain-" + hashlib.sha256(job.encode()).hexdigest()[:16]


# a worker's exit status that the launcher passes on as its own (the same on every
# failed worker): bad input, divergence, a failed save, a hang the watchdog reported, a
# stop on SIGINT / SIGTERM
PASSED_ON_CODES = (*sorted(STOP_CODES), HANG_EXIT_CODE, 128 + signal.SIGINT,
                   128 + signal.SIGTERM)


def inside_worker() -> bool:
    """True in a process started by torchrun / the elastic agent (or with RANK set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ)


def torchrun_args(opts: LaunchOptions, target: list[str]) -> list[str]:
    """torchrun arguments that start ``target`` (``-m module ...`` or ``script ...``)."""
    opts.check_nproc()
    args = ["--nproc-per-node", str(opts.nproc), "--nnodes", opts.nnodes,
            "--max-restarts", str(opts.max_restarts)]
    multi = opts.node_counts() != range(1, 2)
    if multi or opts.rdzv_endpoint:
        if not opts.rdzv_endpoint:
            raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every "
                            "node)")
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint,
                 "--rdzv-id", opts.rdzv_id]
        if opts.node_rank is not None:
            args += ["--node-rank", str(opts.node_rank)]
        if opts.rdzv_conf:
            args += ["--rdzv-conf", opts.rdzv_conf]
        if opts.local_addr:
            args += ["--local-addr", opts.local_addr]
    else:
        args += ["--standalone"]
    return args + target


def worker_threads(nproc: int) -> int:
    """CPU threads each of ``nproc`` local workers computes with: OMP_NUM_THREADS if
    the user set it, else one share of the cores."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // nproc)


def _worker_env(nproc: int) -> None:
    # Set it explicitly, which also keeps torchrun from printing its OMP_NUM_THREADS
    # warning.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(worker_threads(nproc))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # DISTTRAIN_MALLOC=return: the workers return freed buffers (.allocator)
    os.environ.update(allocator_env())


# the agent's own lines while it passes a signal on: the launcher says it in one line
_AGENT_SIGNAL_LINES = ("Received %s death signal", "Sending process %s closing signal")
_AGENT_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                  "torch.distributed.elastic.multiprocessing.api")


def _quiet_signal_lines(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_AGENT_SIGNAL_LINES)


def launch(opts: LaunchOptions, target: list[str]) -> int:
    """Run ``target`` on ``opts.nproc`` workers per node; return an exit code: the
    workers' own when every failed worker exited with the same one of
    :data:`PASSED_ON_CODES` (2: bad input, 3: diverged, 4: a checkpoint save failed,
    75: a hang, 130 / 143: a signal; the agent passes each worker's code through), 75
    when any reported a hang, 128 + the signal when this process was stopped by one
    (the workers get it too and stop as ``checkpoint.on_signal`` says), 1 otherwise."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    _worker_env(opts.nproc)
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).addFilter(_quiet_signal_lines)
    try:
        run(parse_args(torchrun_args(opts, target)))
    except RendezvousError as exc:
        cause = exc.__cause__ or exc
        print(f"disttrain: lost the rendezvous at {opts.rdzv_endpoint or 'localhost'} "
              f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''});"
              " is the network to that host up?", file=sys.stderr)
        return 1
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"disttrain: stopped by {name}; the workers finished their step "
              f"(exit {128 + exc.sigval})", file=sys.stderr)
        return 128 + exc.sigval
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        # workers the agent stopped because another failed show as signals (< 0)
        own = {c for c in codes if isinstance(c, int) and c >= 0}
        if len(own) == 1 and own <= set(PASSED_ON_CODES):
            return own.pop()  # the worker has said why, in one line
        ranks = ", ".join(f"rank {r} (exit {f.exitcode})"
                          for r, f in sorted(exc.failures.items()))
        print(f"disttrain: worker failure: {ranks}", file=sys.stderr)
        return HANG_EXIT_CODE if HANG_EXIT_CODE in codes else 1
    return 0
