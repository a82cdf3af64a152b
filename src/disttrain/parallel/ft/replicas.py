"""Replica groups joined by torchft: the quorum a step runs under, the share of the
global batch it gives this group, the cross-replica reduction, the commit, and the live
recovery of a group that (re)joins.

Each replica group is a torchrun group of its own (its tp x pp ranks). Group rank ``g``
of every group holds the same pieces of the model (the same tp shard, the same pipeline
stage), so rank ``g`` of all groups form one torchft process group, reconfigured by
torchft's :class:`~torchft.Manager` at every change of membership (the quorum the
lighthouse forms each step).

A step under quorum ``(r, n)`` (this group is replica ``r`` of ``n`` present):

- data: the global batch of ``B`` samples at the cursor's position is split into ``n``
  contiguous shares, ``B // n`` each and one more for the first ``B % n``
  (:func:`replica_window`); a missing replica's share is *redistributed*, so every
  committed step trains on the whole global batch;
- reduction: the loss totals and the gradients (each scaled by ``1 / N``, ``N`` the
  global loss-term count) are summed over the ``n`` replicas: the mean over the whole
  batch, the same update as without the failure up to summation order;
- commit: torchft's ``should_commit``; a step whose reduction failed (a replica died
  inside it) changes nothing and is taken again under the next quorum.

Recovery: a group whose step is behind the quorum's receives, from a healthy peer's
same group rank, this rank's parameters, optimizer state, sample position and random
state (torchft's checkpoint transport), never from disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from ...comm.collectives import CollectiveLedger
from ...errors import ConfigError, UserError

# the environment the launcher (or a cluster's job spec) sets on each replica group
REPLICA_GROUP_ENV = "DISTTRAIN_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# the ledger's name for the cross-replica group
REPLICAS_GROUP = "replicas"


def replica_window(global_batch: int, rank: int, count: int) -> tuple[int, int]:
    """Replica ``rank`` of ``count``'s (offset, size) in a global batch: contiguous
    shares, ``global_batch // count`` each, one more for the first ``global_batch %
    count``; concatenated in rank order they are the whole batch."""
    base, extra = divmod(global_batch, count)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def check_lighthouse(address: str, timeout_s: float = 5.0) -> None:
    """Refuse (exit 2) a lighthouse address nothing answers at, before anything starts."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    if not parsed.hostname or not parsed.port:
        raise ConfigError("parallel.lighthouse", address, "not an address",
                          "give http://HOST:PORT of a running torchft_lighthouse")
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError("parallel.lighthouse", address,
                          f"not reachable ({exc.strerror or exc})",
                          "start torchft_lighthouse there first, or leave it empty for "
                          "disttrain train to start one") from None


def config_fingerprint(config_values: dict[str, Any], group_size: int) -> int:
    """A 62-bit digest of what every replica group must share: the config's values and
    the group's number of ranks."""
    # which keys were given explicitly is no difference (and a set's order varies)
    values = {k: v for k, v in config_values.items() if k != "explicit"}
    text = json.dumps([values, group_size], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


@dataclass
class RecoverableState:
    """What a (re)joining group receives from a healthy peer, for this group rank:
    ``module``'s tensors (this rank's pieces), the optimizer state, the sample position
    (``position``, read and written through the cursor) and the random state."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    cursor: Any  # train.cursor.DataCursor (parallel/ imports nothing from train/)

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "position": self.cursor.position, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.cursor.position = int(state["position"])
        torch.set_rng_state(state["rng"])


class ReplicaGroups:
    """This rank's side of the replica groups: a torchft Manager (group rank 0 runs its
    server and talks to the lighthouse) over a reconfigurable process group of the
    same group rank in every replica group.

    ``fingerprint``: :func:`config_fingerprint`; a group whose value differs from the
    quorum's first replica's stops with a ConfigError (exit 2) before its first update.
    """

    def __init__(self, *, state: RecoverableState, ledger: CollectiveLedger,
                 lighthouse: str, replica_group: int, group_rank: int, group_size: int,
                 fingerprint: int, start_step: int, expected: int, device: torch.device,
                 timeout_s: float, bucket_mb: float) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(seconds=timeout_s)
        pg = (ProcessGroupNCCL(timeout=timeout) if device.type == "cuda"
              else ProcessGroupGloo(timeout=timeout))
        self.state, self.ledger, self.device = state, ledger, device
        self.replica_group, self.fingerprint = replica_group, fingerprint
        self.expected = expected  # parallel.replicas
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.manager = Manager(
            pg=pg, load_state_dict=state.load_state_dict, state_dict=state.state_dict,
            min_replica_size=1, use_async_quorum=False, init_sync=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=group_rank, world_size=group_size, lighthouse_addr=lighthouse,
            replica_id=f"disttrain_{replica_group}")
        self.manager.load_state_dict({"step": start_step, "batches_committed": 0})
        self.checked = False
        self.short_steps: list[int] = []  # 1-based steps some replica sat out
        self.retried = 0  # steps taken again after a failed reduction
        self.healed_at: int | None = None

    # ----------------------------------------------------------------- the quorum
    def start_step(self, step: int) -> int:
        """Join the quorum for the next step; a group behind the others is healed here
        (its state replaced by a peer's). Returns the 0-based step to take.

        A job's first step waits (up to ``STARTUP_WAIT_S``) for every replica group to
        start: the quorum is formed again, nothing committed, until all are in it."""
        self.manager.start_quorum()
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        deadline = time.monotonic() + (0.0 if restarted else STARTUP_WAIT_S)
        while (self.manager.current_step() == 0 and self.count < self.expected
               and time.monotonic() < deadline):
            self.manager.report_error(RuntimeError("waiting for every replica group"))
            self.manager.should_commit()  # False: the quorum is formed again
            time.sleep(0.05)
            self.manager.start_quorum()
        joined = self.manager.current_step()
        if joined != step:
            self.healed_at = joined
        return joined

    @property
    def rank(self) -> int:
        """This group's rank among the replicas in the current quorum."""
        rank = self.manager.participating_rank()
        return 0 if rank is None else rank

    @property
    def count(self) -> int:
        """The replicas in the current quorum."""
        return max(self.manager.num_participants(), 1)

    def window(self, global_batch: int) -> tuple[int, int]:
        """This group's (offset, size) of the global batch under the current quorum."""
        return replica_window(global_batch, self.rank, self.count)

    # ----------------------------------------------------------------- reduction
    def check_config(self) -> None:
        """Once: compare this group's fingerprint with the quorum's first replica's (a
        sum in which only that replica's is non-zero)."""
        if self.checked:
            return
        first = torch.tensor([self.fingerprint if self.rank == 0 else 0],
                             dtype=torch.int64, device=self.device)
        self._reduce([first])
        if self.manager.errored() is not None:
            return  # a replica died: the step is retried, and the check with it
        if int(first.item()) != self.fingerprint:
            raise ConfigError(
                f"replica group {self.replica_group}", f"fingerprint {self.fingerprint}",
                "its config or number of ranks differs from the other replica groups' "
                f"(fingerprint {int(first.item())})",
                "start every replica group with the same config and --nproc")
        self.checked = True

    def reduce_totals(self, totals: torch.Tensor) -> None:
        """Sum the step's loss totals ([loss sum, loss terms], float64) over the
        replicas: the terms become the global count the gradients are scaled by."""
        self.check_config()
        self._reduce([totals])

    def reduce_gradients(self, grads: list[torch.Tensor]) -> None:
        """Sum ``grads`` (this rank's gradient pieces, already scaled by 1 / N) over the
        replicas, in buckets of ``parallel.bucket_mb`` of one dtype each."""
        self._reduce(grads)

    def _reduce(self, tensors: list[torch.Tensor]) -> None:
        works, staged = [], []
        for bucket in _buckets(tensors, self.bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            rec = self.ledger.record("all_reduce", REPLICAS_GROUP, flat,
                                     "parallel.ft.ReplicaGroups._reduce", self.count)
            works.append((rec, self.manager.allreduce(flat, reduce_op=_SUM)))
            staged.append((bucket, flat))
        for rec, work in works:
            with self.ledger.blocked_on(rec):
                work.wait()
        for bucket, flat in staged:
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def commit(self, done: int) -> bool:
        """torchft's decision for the step about to update: False when a reduction
        failed (the step is taken again). Counts a committed step that ran short."""
        ok = self.manager.should_commit()
        if not ok:
            self.retried += 1
        elif self.count < self.expected:
            self.short_steps.append(done)
        return ok

    def metrics(self) -> dict[str, Any]:
        """Fields for metrics records and the summary."""
        return {"ft_replicas": self.count, "ft_short_steps": list(self.short_steps),
                "ft_retried_steps": self.retried, "ft_healed_at": self.healed_at}

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of one dtype, each at most ``limit`` bytes (or one tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or out[-1][0].dtype != t.dtype or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def _sum_op() -> Any:
    from torch.distributed import ReduceOp
    return ReduceOp.SUM


_SUM = _sum_op()


def replica_group_from_env() -> int:
    """This process's replica group (``DISTTRAIN_REPLICA_GROUP``, set by the launcher)."""
    value = os.environ.get(REPLICA_GROUP_ENV, "")
    if not value.isdigit():
        raise UserError(f"parallel.fault_tolerance = 'replica' needs {REPLICA_GROUP_ENV} "
                        f"(this group's index, 0..replicas-1; got {value!r}): start the "
                        "job with disttrain train, or set it in each group's environment")
    return int(value)


def build_replica_groups(config: Any, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                         cursor: Any, ledger: CollectiveLedger, group_rank: int,
                         group_size: int, device: torch.device, start_step: int
                         ) -> ReplicaGroups:
    """This rank's :class:`ReplicaGroups` for ``config`` (a :class:`~disttrain.Config`
    with ``parallel.fault_tolerance = "replica"``); the lighthouse is
    ``parallel.lighthouse``, else ``TORCHFT_LIGHTHOUSE`` (set by the launcher)."""
    p = config.parallel
    lighthouse = p.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not lighthouse:
        raise ConfigError("parallel.lighthouse", lighthouse, "no lighthouse to join",
                          f"start the job with disttrain train, or give a running "
                          f"torchft_lighthouse's address (or set {LIGHTHOUSE_ENV})")
    check_lighthouse(lighthouse)
    values = dataclasses.asdict(config)
    return ReplicaGroups(
        state=RecoverableState(module, optimizer, cursor), ledger=ledger,
        lighthouse=lighthouse, replica_group=replica_group_from_env(),
        group_rank=group_rank, group_size=group_size,
        fingerprint=config_fingerprint(values, group_size), start_step=start_step,
        expected=p.replicas,
        device=device, timeout_s=min(p.timeout_s, FT_TIMEOUT_S), bucket_mb=p.bucket_mb)


# how long a job's first step waits for every replica group to join the quorum
STARTUP_WAIT_S = 60.0
# the longest a survivor waits on a lost replica inside a collective before the step is
# given up and retried (the quorum's heartbeat drops a dead replica well before this)
FT_TIMEOUT_S = 30.0
