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
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast
from urllib.parse import urlparse

import torch
from torch import nn

from ...comm.collectives import CollectiveLedger
from ...comm.transport import yield_to_compute
from ...errors import ConfigError, TrainingStopped, UserError
from ...names import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV

# the ledger's name for the cross-replica group
REPLICAS_GROUP = "replicas"


class ReplicaLeftBehind(TrainingStopped):
    """A restarted replica group found no live peer to heal from within
    ``parallel.ft_rejoin_s``: the others finished or failed. It stops rather than train
    alone on a state the others no longer share."""

    def __init__(self, group: int, waited_s: float) -> None:
        super().__init__(
            f"replica group {group} restarted but no other replica group joined the "
            f"quorum within parallel.ft_rejoin_s={waited_s:g} s (they finished or "
            "failed): not training alone; take the final weights of the groups that "
            "finished, or resume the job from its last checkpoint")


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
    (``position``, read and written through the cursor), the random state, and the
    losses of the peer's last steps (``losses``, the window the final train loss is the
    mean of: a group healed at the last step trained none of its own)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    cursor: Any  # train.cursor.DataCursor (parallel/ imports nothing from train/)
    losses: deque[float]

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "position": self.cursor.position, "rng": torch.get_rng_state(),
                "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.cursor.position = int(state["position"])
        torch.set_rng_state(state["rng"])
        self.losses.clear()
        self.losses.extend(float(v) for v in state["losses"])


class ReplicaGroups:
    """This rank's side of the replica groups: a torchft Manager (group rank 0 runs its
    server and talks to the lighthouse) over a reconfigurable process group of the
    same group rank in every replica group.

    ``fingerprint``: :func:`config_fingerprint`; compared at every step (it travels
    with the loss totals), so a group whose value differs from the quorum's first
    replica's stops with a ConfigError (exit 2) before it updates anything.

    ``store``: (host, port) of a TCPStore this attempt of the group started
    (:func:`attempt_store`): torchft's Manager finds its server's address there and the
    cross-replica groups rendezvous under it, so nothing a previous attempt left in the
    torchrun store is read. ``rejoin_s``: how long a restarted group waits for a live
    peer to heal from, how long the first step waits for every group to start, and how
    long a finished group waits for missing ones to rejoin.
    """

    def __init__(self, *, state: RecoverableState, ledger: CollectiveLedger,
                 lighthouse: str, replica_group: int, group_rank: int, group_size: int,
                 fingerprint: int, start_step: int, expected: int, device: torch.device,
                 timeout_s: float, bucket_mb: float, store: tuple[str, int],
                 store_server: Any, rejoin_s: float) -> None:
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
            replica_id=f"disttrain_{replica_group}", store_addr=store[0],
            store_port=store[1])
        self.manager.load_state_dict({"step": start_step, "batches_committed": 0})
        self.rejoin_s = rejoin_s
        self.store_server = store_server  # served while the groups live (None off rank 0)
        # a restarted attempt must heal from a live peer before it trains (never alone)
        self.restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        self.quorum_open = False  # a quorum was formed for a step not yet committed
        # host time spent in torchft's per-step round trips (quorum, should_commit)
        self.quorum_s = self.commit_s = 0.0
        self.rounds = 0
        self.short_steps: list[int] = []  # 1-based steps some replica sat out
        self.short_recorded = 0  # how many of them a metrics record already named
        self.retried = 0  # steps taken again after a failed reduction
        self.healed_at: int | None = None

    # ----------------------------------------------------------------- the quorum
    def start_step(self, step: int) -> int:
        """Join the quorum for the next step; a group behind the others is healed here
        (its state replaced by a peer's). Returns the 0-based step to take.

        A job's first step waits (up to ``rejoin_s``) for every replica group to
        start, and a restarted group waits as long for a live peer: the
        quorum is formed again, nothing committed, until they are in it. A restarted
        group that finds no peer stops (:class:`ReplicaLeftBehind`) rather than train
        alone while the others may still be stepping."""
        started = time.monotonic()
        self.manager.start_quorum()
        if self.rounds:  # not the first, which waits for the other groups to start
            self.quorum_s += time.monotonic() - started
        while self._waiting(started):
            self._skip_round()
        if self.restarted and self.count == 1 and self.expected > 1:
            raise ReplicaLeftBehind(self.replica_group, self.rejoin_s)
        self.restarted = False  # in a quorum with a peer: healed or level with it
        self.quorum_open = True
        if self.device.type == "cpu":  # a new quorum may have made new transport threads
            yield_to_compute()
        joined = self.manager.current_step()
        if joined != step:
            self.healed_at = joined
        return joined

    def _waiting(self, started: float) -> bool:
        waited = time.monotonic() - started
        if self.restarted and self.expected > 1:
            return self.count == 1 and waited < self.rejoin_s
        first = self.manager.current_step() == 0 and not self.restarted
        return first and self.count < self.expected and waited < self.rejoin_s

    def _skip_round(self) -> None:
        """Give up the current quorum without committing anything and form the next."""
        self.manager.report_error(RuntimeError("waiting for replica groups"))
        self.manager.should_commit()  # False: nothing changes
        time.sleep(0.05)
        self.manager.start_quorum()

    def finish(self) -> None:
        """At the end of the run: wait (up to ``rejoin_s``) for the groups missing from
        the quorum to rejoin and heal from this one, then leave together (a collective
        over the whole quorum, so no group leaves while a peer still reads its state).
        A group that healed into the last step uses the quorum it healed in."""
        started = time.monotonic()
        if not self.quorum_open:
            self.manager.start_quorum()
        while self.count < self.expected and time.monotonic() - started < self.rejoin_s:
            self._skip_round()
        done = torch.zeros(1, device=self.device)
        self._reduce([done])  # waits for every peer's recovery (their quorum) to end
        self.manager.report_error(RuntimeError("the run is over"))
        self.manager.should_commit()
        self.quorum_open = False

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
    def reduce_totals(self, totals: torch.Tensor) -> None:
        """Sum the step's loss totals ([loss sum, loss terms], float64) over the
        replicas: the terms become the global count the gradients are scaled by.

        The config fingerprint travels with them (two 31-bit halves, exact in float64,
        non-zero only on the quorum's first replica), so every step checks that the
        groups present, a rejoined one included, run the same config."""
        first = self.rank == 0
        halves = [self.fingerprint >> 31, self.fingerprint & (2**31 - 1)] if first else [0, 0]
        digest = torch.tensor(halves, dtype=torch.float64, device=self.device)
        self._reduce([totals, digest])
        if self.manager.errored() is not None:
            return  # a replica died: the step is retried, and the check with it
        theirs = (int(digest[0].item()) << 31) | int(digest[1].item())
        if theirs != self.fingerprint:
            raise ConfigError(
                f"replica group {self.replica_group}", f"fingerprint {self.fingerprint}",
                "its config or number of ranks differs from the other replica groups' "
                f"(fingerprint {theirs})",
                "start every replica group with the same config and --nproc")

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
        started = time.monotonic()
        ok = self.manager.should_commit()
        self.commit_s += time.monotonic() - started
        self.rounds += 1
        self.quorum_open = False
        if not ok:
            self.retried += 1
        elif self.count < self.expected:
            self.short_steps.append(done)
        return ok

    def record_figures(self) -> dict[str, Any]:
        """Fields for a metrics record: the replicas present, the steps that ran short
        since the previous record (only when there were any: each short step is named
        in one record), the counters and the round trips' host time."""
        new = self.short_steps[self.short_recorded:]
        self.short_recorded = len(self.short_steps)
        return {**self._figures(), **({"ft_short_steps": new} if new else {})}

    def summary_figures(self) -> dict[str, Any]:
        """Fields for the summary: every step that ran short, and the rest as in a
        record."""
        return {**self._figures(), "ft_short_steps": list(self.short_steps)}

    def _figures(self) -> dict[str, Any]:
        rounds = max(self.rounds, 1)  # quorum_s: one fewer (the first is left out)
        return {"ft_replicas": self.count, "ft_retried_steps": self.retried,
                "ft_healed_at": self.healed_at,
                "ft_quorum_s_per_step": self.quorum_s / max(rounds - 1, 1),
                "ft_commit_s_per_step": self.commit_s / rounds}

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


def attempt_store(world: Any, group_rank: int) -> tuple[Any, tuple[str, int]]:
    """A TCPStore for this attempt of the replica group, served by its group rank 0 on
    a free port; the (host, port) every rank of the group connects to (sent over
    ``world``, the group's communicator). Returns (the server, or None off rank 0; the
    address). A restarted attempt gets a new, empty store: torchrun's keeps what the
    previous attempt wrote (torchft's server address among it) under the same keys."""
    from torch.distributed import TCPStore

    server, address = None, None
    if group_rank == 0:
        host = os.environ.get("MASTER_ADDR", "localhost")
        server = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        address = (host, server.port)
    return server, cast(tuple[str, int], world.broadcast_object(address))


def build_replica_groups(config: Any, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                         cursor: Any, losses: deque[float], ledger: CollectiveLedger,
                         world: Any, group_rank: int, group_size: int,
                         device: torch.device, start_step: int) -> ReplicaGroups:
    """This rank's :class:`ReplicaGroups` for ``config`` (a :class:`~disttrain.Config`
    with ``parallel.fault_tolerance = "replica"``); the lighthouse is
    ``parallel.lighthouse``, else ``TORCHFT_LIGHTHOUSE`` (set by the launcher).

    torchft's Manager starts heartbeating to the lighthouse here (group rank 0): call
    it when the group is ready to step, not before a long evaluation, or every quorum
    of the others waits for this group (up to the lighthouse's join timeout)."""
    p = config.parallel
    lighthouse = p.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not lighthouse:
        raise ConfigError("parallel.lighthouse", lighthouse, "no lighthouse to join",
                          f"start the job with disttrain train, or give a running "
                          f"torchft_lighthouse's address (or set {LIGHTHOUSE_ENV})")
    check_lighthouse(lighthouse)
    server, store = attempt_store(world, group_rank)
    values = dataclasses.asdict(config)
    return ReplicaGroups(
        state=RecoverableState(module, optimizer, cursor, losses), ledger=ledger,
        lighthouse=lighthouse, replica_group=replica_group_from_env(),
        group_rank=group_rank, group_size=group_size,
        fingerprint=config_fingerprint(values, group_size), start_step=start_step,
        expected=p.replicas, device=device, timeout_s=p.timeout_s, bucket_mb=p.bucket_mb,
        store=store, store_server=server, rejoin_s=p.ft_rejoin_s)
