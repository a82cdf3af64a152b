"""Synchronisation modes (``[train] sync``): how data-parallel replicas stay in step.

- ``every_step``: gradients all-reduced in every step (:class:`EveryStep`);
- ``local_sgd``: parameters averaged every ``sync_every`` steps (:class:`LocalSGD`);
- ``diloco``: an outer Nesterov step on averaged pseudo-gradients (:class:`DiLoCo`);
- ``async``: parameter servers and workers on point-to-point messages
  (:class:`AsyncParameterServer`);
- ``fedavg``: federated averaging over non-IID client partitions (:class:`FedAvg`).

Each is a :class:`~..strategy.SyncMode` entry (:data:`SYNC_MODES_BUILTIN`, registered in
:mod:`..registry`); the modes other than every_step train on the :data:`LOCAL`
data-parallel strategy (:class:`LocalGradients`: no communication inside a step).
"""

from __future__ import annotations

from ...comm.codecs import build_codec
from ...names import (
    STRATEGY_LOCAL,
    SYNC_ASYNC,
    SYNC_DILOCO,
    SYNC_EVERY_STEP,
    SYNC_FEDAVG,
    SYNC_LOCAL_SGD,
)
from ..interfaces import GradSync, ShardedState
from ..replicated import ReplicatedState, check_replica
from ..strategy import DataParallelStrategy, StrategyContext, SyncContext, SyncMode
from .async_ps import AsyncParameterServer, AsyncReport, assign_shards
from .check import apart_check, check_async
from .diloco import DiLoCo, OuterNesterov, outer_round
from .fedavg import FedAvg, choose_clients, client_partition
from .local import LocalGradients
from .local_sgd import LocalSGD
from .modes import EveryStep
from .vectors import flatten, unflatten_into, weighted_average


def _local_sgd(ctx: SyncContext) -> LocalSGD:
    return LocalSGD(ctx.model, ctx.replicas, ctx.train.sync_every,
                    build_codec(ctx.comm, ctx.train.seed))


def _diloco(ctx: SyncContext) -> DiLoCo:
    t = ctx.train
    return DiLoCo(ctx.model, ctx.replicas, t.sync_every, t.outer_lr, t.outer_momentum,
                  build_codec(ctx.comm, t.seed))


def _fedavg(ctx: SyncContext) -> FedAvg:
    t = ctx.train
    return FedAvg(ctx.model, ctx.replicas, num_samples=ctx.num_samples, every=t.sync_every,
                  fraction=t.fed_fraction, seed=t.seed)


def _async(ctx: SyncContext) -> AsyncParameterServer:
    t = ctx.train
    return AsyncParameterServer(ctx.model, ctx.replicas, servers=t.ps_servers,
                                staleness_bound=t.staleness_bound,
                                accumulate=t.ps_accumulate, on_nonfinite=t.on_nonfinite)


SYNC_MODES_BUILTIN = (
    SyncMode(SYNC_EVERY_STEP, lambda ctx: EveryStep()),
    SyncMode(SYNC_LOCAL_SGD, _local_sgd, apart_check()),
    SyncMode(SYNC_DILOCO, _diloco, apart_check()),
    SyncMode(SYNC_FEDAVG, _fedavg, apart_check()),
    SyncMode(SYNC_ASYNC, _async, apart_check(then=check_async)),
)


def build_local(ctx: StrategyContext) -> tuple[GradSync, ShardedState]:
    """Replicas on their own gradients (broadcast from dp rank 0 once, unless fresh)."""
    grads = LocalGradients(ctx.module, ctx.replicas, broadcast=not ctx.fresh)
    return grads, ReplicatedState(ctx.module, ctx.placement, ctx.replicas.rank,
                                  ctx.replicas.size)


LOCAL = DataParallelStrategy(STRATEGY_LOCAL, build_local,
                             check_replica(STRATEGY_LOCAL, wants_local=True))

__all__ = ["LOCAL", "SYNC_MODES_BUILTIN", "AsyncParameterServer", "AsyncReport", "DiLoCo",
           "EveryStep", "FedAvg", "LocalGradients", "LocalSGD", "OuterNesterov",
           "assign_shards", "build_local", "choose_clients", "client_partition", "flatten",
           "outer_round", "unflatten_into", "weighted_average"]
