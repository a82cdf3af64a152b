"""What a strategy is, whichever kind: a name, a builder, a config check.

Three kinds of choice change how ranks communicate, and each registers the same way
(:mod:`.registry`):

- a data-parallel strategy (``parallel.strategy``: ddp, zero, local): builds this
  rank's :class:`~.interfaces.GradSync` and :class:`~.interfaces.ShardedState` from a
  :class:`StrategyContext`;
- a sync mode (``train.sync``: every_step, local_sgd, diloco, async, fedavg): builds the
  :class:`~.interfaces.SyncStrategy` run between steps from a :class:`SyncContext`;
- an optimizer (``train.optimizer``): builds the optimizer from an
  :class:`OptimizerContext`, and may wrap the gradient side (1-bit Adam's exchange
  replaces the all-reduce once the variance is frozen).

Each ``check(config, layout)`` runs before any process group exists and raises
:class:`~disttrain.errors.ConfigError` with the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..comm.spans import SpanRecorder
from ..config.layout import Layout
from ..config.schema import CommConfig, Config, ParallelConfig, TrainConfig
from ..names import STRATEGY_AUTO, STRATEGY_DDP, STRATEGY_LOCAL, STRATEGY_ZERO, SYNC_EVERY_STEP
from .interfaces import GradSync, ShardedState, SyncStrategy
from .placement import Placement

if TYPE_CHECKING:  # zero/ imports this module for its entry
    from .zero.flat import Unit

Check = Callable[[Config, Layout], None]

# parallel.grad_reduce_dtype -> the dtype gradients travel in
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def selected_strategy(config: Config) -> str:
    """The strategy name ``parallel.strategy`` resolves to: ``auto`` is ``zero`` with a
    ZeRO stage, ``local`` when the sync mode is not every_step (replicas step on their
    own gradients), else ``ddp``."""
    name = config.parallel.strategy
    if name != STRATEGY_AUTO:
        return name
    if config.parallel.zero:
        return STRATEGY_ZERO
    return STRATEGY_DDP if config.train.sync == SYNC_EVERY_STEP else STRATEGY_LOCAL


def no_check(config: Config, layout: Layout) -> None:
    """No constraints beyond the layout's."""


@dataclass(frozen=True, kw_only=True)
class StrategyContext:
    """What a data-parallel strategy is built from.

    ``module``: this rank's part of the model (the model, or its pipeline chunks);
    ``placement``: its parameters' names and boxes in the full model; ``units``: its
    parameters grouped per block and per backward scope (for sharding);
    ``replicas``: the replica group (the ranks holding the same parameters: dp, or
    the flattened group of every dimension whose ranks do; ``dp_comm`` is its older
    name); ``parallel`` / ``comm``: its config sections;
    ``seed``: for codecs that sample; ``tracer``: a span recorder (or None);
    ``fresh``: the parameters are filled after the build from a source that gives every
    rank the same values (a model built on the meta device): nothing to broadcast.
    A strategy registered with ``allocates`` gets any parameter still on the meta device
    and gives it storage itself (ZeRO: only this rank's shard); the others get the
    parameters with storage, on the replica group's device.
    """

    module: nn.Module
    placement: Placement
    units: list[Unit]
    replicas: Communicator
    parallel: ParallelConfig
    comm: CommConfig
    seed: int = 0
    tracer: SpanRecorder | None = None
    fresh: bool = False

    @property
    def dp_comm(self) -> Communicator:
        """:attr:`replicas` under its older name."""
        return self.replicas


@dataclass(frozen=True)
class DataParallelStrategy:
    """``parallel.strategy = name``: ``build`` makes this rank's gradient sync and
    state; ``allocates``: ``build`` gives meta parameters their storage."""

    name: str
    build: Callable[[StrategyContext], tuple[GradSync, ShardedState]]
    check: Check = no_check
    allocates: bool = False


@dataclass(frozen=True, kw_only=True)
class SyncContext:
    """What a sync mode is built from: the whole model (replicas keep it whole), the
    replica group ``replicas`` (``dp_comm``: its older name; the world for a mode whose
    ranks play different roles), the training set's size (federated partitions), the
    ``train`` and ``comm`` sections."""

    model: nn.Module
    replicas: Communicator
    num_samples: int
    train: TrainConfig
    comm: CommConfig

    @property
    def dp_comm(self) -> Communicator:
        """:attr:`replicas` under its older name."""
        return self.replicas


@dataclass(frozen=True)
class SyncMode:
    """``train.sync = name``: ``build`` makes what runs between steps (any mode but
    every_step trains on the ``local`` strategy under ``parallel.strategy=auto``)."""

    name: str
    build: Callable[[SyncContext], SyncStrategy]
    check: Check = no_check


@dataclass(frozen=True, kw_only=True)
class OptimizerContext:
    """What an optimizer is built from: ``groups`` (the composed state's parameter
    groups: matrices decayed, the rest not; ZeRO's flat shards), the peak ``lr``, the
    ``train`` section and the replica group ``replicas`` (an optimizer that
    communicates uses it; ``dp_comm``: its older name)."""

    groups: list[dict]
    lr: float
    train: TrainConfig
    replicas: Communicator | None

    @property
    def dp_comm(self) -> Communicator | None:
        """:attr:`replicas` under its older name."""
        return self.replicas


class UsesOptimizer(Protocol):
    """A gradient side that reads the optimizer built after it (1-bit Adam's phase):
    handed it once built (:meth:`bind_optimizer`)."""

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...


class GradsUsingOptimizer(GradSync, UsesOptimizer, Protocol):
    """Both: what an optimizer's ``wrap_grads`` returns."""


@dataclass(frozen=True)
class OptimizerKind:
    """``train.optimizer = name``. ``wrap_grads(grads, dp)``: the gradient side the
    optimizer needs over the data-parallel strategy's (None: that one unchanged); the
    composition hands it the optimizer once built."""

    name: str
    build: Callable[[OptimizerContext], torch.optim.Optimizer]
    check: Check = no_check
    wrap_grads: Callable[[GradSync, Communicator], GradsUsingOptimizer] | None = None
