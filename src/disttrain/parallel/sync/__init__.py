"""Synchronisation modes (``[train] sync``): how data-parallel replicas stay in step.

- ``every_step``: gradients all-reduced in every step (:class:`SyncStrategy`);
- ``local_sgd``: parameters averaged every ``sync_every`` steps (:class:`LocalSGD`);
- ``diloco``: an outer Nesterov step on averaged pseudo-gradients (:class:`DiLoCo`);
- ``async``: parameter servers and workers on point-to-point messages
  (:class:`AsyncParameterServer`);
- ``fedavg``: federated averaging over non-IID client partitions (:class:`FedAvg`).

:func:`build_sync` makes the one a config asks for; the trainer calls its hooks.
"""

from __future__ import annotations

from torch import nn

from ...comm.codecs import build_codec
from ...comm.collectives import Communicator
from ...config.schema import CommConfig, TrainConfig
from ...names import SYNC_ASYNC, SYNC_DILOCO, SYNC_FEDAVG, SYNC_LOCAL_SGD
from .async_ps import AsyncParameterServer, AsyncReport, assign_shards
from .base import LocalGradients, SyncStrategy, flatten, unflatten_into, weighted_average
from .diloco import DiLoCo, OuterNesterov, outer_round
from .fedavg import FedAvg, choose_clients, client_partition
from .local_sgd import LocalSGD


def build_sync(train: TrainConfig, model: nn.Module, comm: Communicator,
               num_samples: int, comm_config: CommConfig | None = None) -> SyncStrategy:
    """The strategy for ``train.sync`` over ``comm`` (the dp group; the world for
    async); ``num_samples`` is the training set's size (fedavg partitions it);
    ``comm_config``'s codec compresses local SGD's per-round updates and DiLoCo's
    pseudo-gradient."""
    mode = train.sync
    codec = build_codec(comm_config, train.seed) if comm_config is not None else None
    if mode == SYNC_LOCAL_SGD:
        return LocalSGD(model, comm, train.sync_every, codec)
    if mode == SYNC_DILOCO:
        return DiLoCo(model, comm, train.sync_every, train.outer_lr, train.outer_momentum,
                      codec)
    if mode == SYNC_FEDAVG:
        return FedAvg(model, comm, num_samples=num_samples, every=train.sync_every,
                      fraction=train.fed_fraction, seed=train.seed)
    if mode == SYNC_ASYNC:
        return AsyncParameterServer(model, comm, servers=train.ps_servers,
                                    staleness_bound=train.staleness_bound,
                                    accumulate=train.ps_accumulate,
                                    on_nonfinite=train.on_nonfinite)
    return SyncStrategy()


__all__ = ["AsyncParameterServer", "AsyncReport", "DiLoCo", "FedAvg", "LocalGradients",
           "LocalSGD", "OuterNesterov", "SyncStrategy", "assign_shards", "build_sync",
           "choose_clients", "client_partition", "flatten", "outer_round",
           "unflatten_into", "weighted_average"]
