"""Process-group start-up from the environment torchrun (or the test harness) sets.

A worker learns its rank from ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (set by
torchrun, or from SLURM's variables for a task ``srun`` started as one rank); without
them it is a world of one. :func:`world_size_from_env` is readable before any process group
exists, so the config can be validated first.

In the shared-GPU test mode (``DISTTRAIN_SHARED_GPU=1``, validated by
:func:`~disttrain.config.consistency.check_shared_gpu`) every rank takes
``cuda:(LOCAL_RANK mod GPUs)`` and the process group is Gloo (:mod:`disttrain.comm.staging`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm import CollectiveLedger, release_groups
from ..comm.staging import shared_gpu
from ..comm.transport import transport_priority
from ..errors import UserError
from ..launch.slurm import adopt_slurm_env
from ..names import SHARED_GPU_ENV


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    backend: str
    rank: int
    world_size: int
    local_rank: int
    owns_process_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    adopt_slurm_env()  # a task srun started as one rank
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(preference: str, local_rank: int, existing_backend: str | None = None
                ) -> torch.device:
    """``cuda:local_rank`` for ``preference`` cuda, or auto with a GPU present, else the
    CPU. Under auto, a process group that already exists decides: one that cannot move
    CUDA tensors (Gloo, as the CPU test harness creates) keeps the run on the CPU. In
    the shared-GPU test mode: ``cuda:(local_rank mod GPUs)``, whatever the group."""
    if shared_gpu():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    group_moves_cuda = existing_backend is None or "nccl" in existing_backend
    gpu = preference == "cuda" or (preference == "auto" and torch.cuda.is_available()
                                   and group_moves_cuda)
    if gpu:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_runtime(device_preference: str = "auto", backend: str = "auto",
                 timeout_s: float = 600.0) -> Runtime:
    """Initialise the default process group unless one exists; pick the device (cuda
    with NCCL when a GPU is present and nothing says otherwise, else the CPU with
    Gloo; cuda with Gloo in the shared-GPU test mode)."""
    if not dist.is_initialized():
        adopt_slurm_env()  # a task srun started as one rank: SLURM's variables
    transport_priority()  # a bad value refused before any process group
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    existing = dist.get_backend() if dist.is_initialized() else None
    if shared_gpu() and existing not in (None, "gloo"):
        raise UserError(f"{SHARED_GPU_ENV}=1 runs every rank's collectives through Gloo, "
                        f"but the process group is {existing}; create it with Gloo or "
                        f"unset {SHARED_GPU_ENV}")
    device = pick_device(device_preference, local_rank, existing)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" and not shared_gpu() else "gloo"
    owns = not dist.is_initialized()
    if owns:
        timeout = timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_attempt_store(timeout), timeout=timeout,
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        elif "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:  # a plain `python script.py`: a world of one, no rendezvous needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if shared_gpu() and dist.get_rank() == 0:
        print(f"disttrain: {SHARED_GPU_ENV}=1, a test mode: {dist.get_world_size()} ranks "
              f"share {torch.cuda.device_count()} GPU(s) through Gloo, collectives staged "
              "through host memory; its speed says nothing about NCCL", file=sys.stderr)
    return Runtime(device=device, backend=dist.get_backend(), rank=dist.get_rank(),
                   world_size=dist.get_world_size(), local_rank=local_rank,
                   owns_process_group=owns)


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The elastic agent's store, with keys scoped to this restart attempt.

    The agent keeps one store for the whole job, so after a restart the new workers
    would find the previous attempt's keys (a dead rank's address, spent counters) and
    fail to connect or wait forever. A prefix per attempt gives each incarnation a
    clean namespace.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"disttrain/attempt_{attempt}", store)


def shutdown(runtime: Runtime, ledger: CollectiveLedger | None = None) -> None:
    """Destroy the process group this run created (none it was handed), then free the
    groups ``ledger``'s communicators hold (:func:`~disttrain.comm.release_groups`),
    so no Gloo worker thread outlives them into the interpreter's exit."""
    if runtime.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
        if ledger is not None:
            release_groups(ledger)
