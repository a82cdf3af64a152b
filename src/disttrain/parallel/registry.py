"""Data-parallel strategies by name: how replicas share gradients and training state.

A strategy is registered once, here or by user code, with its builder and its
compatibility check; ``parallel.strategy`` selects it (``auto``: ``zero`` when
``parallel.zero > 0``, ``local`` when ``train.sync`` is not ``every_step``, else
``ddp``). The builder gets a :class:`StrategyContext` and returns the
:class:`~.interfaces.GradSync` and :class:`~.interfaces.ShardedState` of this rank; the
check gets the whole config and the resolved layout before any process group exists
and raises :class:`~disttrain.errors.ConfigError` with the fix.

    register_strategy("mine", build=lambda ctx: (MyGrads(ctx), MyState(ctx)))
    Trainer(model, data, loss, {"parallel": {"strategy": "mine"}}).fit()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.codecs import CAST_DTYPES, build_codec
from ..comm.collectives import Communicator
from ..config.schema import CommConfig, Config, ParallelConfig
from ..errors import ConfigError
from ..names import SYNC_EVERY_STEP
from ..config.layout import Layout
from .data import DataParallel
from .interfaces import GradSync, ShardedState
from .placement import Placement
from .replicated import ReplicatedState
from .sync.base import LocalGradients
from .zero import Unit, ZeroDataParallel
from .zero.check import check_zero

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class StrategyContext:
    """What a data-parallel strategy is built from.

    ``module``: this rank's part of the model (the model, or its pipeline chunks);
    ``placement``: its parameters' names and boxes in the full model; ``units``: its
    parameters grouped per block and per backward scope (for sharding);
    ``dp_comm``: the dp group; ``parallel`` / ``comm``: its config sections;
    ``seed``: for codecs that sample; ``tracer``: a span recorder (or None);
    ``fresh``: the parameters are filled after the build from a source that gives every
    rank the same values (a model built on the meta device): nothing to broadcast.
    A strategy registered with ``allocates`` gets any parameter still on the meta device
    and gives it storage itself (ZeRO: only this rank's shard); the others get the
    parameters with storage, on the dp group's device.
    """

    module: nn.Module
    placement: Placement
    units: list[Unit]
    dp_comm: Communicator
    parallel: ParallelConfig
    comm: CommConfig
    seed: int = 0
    tracer: object | None = None
    fresh: bool = False


Build = Callable[[StrategyContext], tuple[GradSync, ShardedState]]
Check = Callable[[Config, Layout], None]


def _no_check(config: Config, layout: Layout) -> None:
    """No constraints beyond the layout's."""


@dataclass(frozen=True)
class Strategy:
    name: str
    build: Build
    check: Check = _no_check
    allocates: bool = False


_STRATEGIES: dict[str, Strategy] = {}


def register_strategy(name: str, build: Build, check: Check = _no_check, *,
                      allocates: bool = False) -> None:
    """Make ``parallel.strategy = name`` build this rank's gradient sync and state with
    ``build``; ``check`` refuses configurations it cannot train, before launch;
    ``allocates``: ``build`` gives meta parameters their storage (see
    :class:`StrategyContext`)."""
    _STRATEGIES[name] = Strategy(name, build, check, allocates)


def strategy_names() -> list[str]:
    return sorted(_STRATEGIES)


def selected_strategy(config: Config) -> str:
    """The strategy name ``parallel.strategy`` resolves to."""
    name = config.parallel.strategy
    if name != "auto":
        return name
    if config.parallel.zero:
        return "zero"
    return "ddp" if config.train.sync == SYNC_EVERY_STEP else "local"


def get_strategy(config: Config) -> Strategy:
    name = selected_strategy(config)
    if name not in _STRATEGIES:
        raise ConfigError("parallel.strategy", name, "is not a registered strategy",
                          f"use auto or one of {', '.join(strategy_names())} (or call "
                          "disttrain.parallel.register_strategy first)")
    return _STRATEGIES[name]


# --------------------------------------------------------------------- built-ins
def _build_ddp(ctx: StrategyContext) -> tuple[GradSync, ShardedState]:
    reduce_dtype = WIRE_DTYPES[ctx.parallel.grad_reduce_dtype]
    codec = build_codec(ctx.comm, ctx.seed)
    grads: GradSync
    if ctx.dp_comm.size == 1 and codec is None and reduce_dtype == torch.float32:
        # nothing to reduce: the gradients autograd accumulates, as a plain loop's
        # (a lower-precision wire or a codec still rounds them as a larger dp would)
        grads = LocalGradients(ctx.module, ctx.dp_comm, broadcast=False,
                               zeros_for_unused=True)
        return grads, ReplicatedState(ctx.module, ctx.placement, 0, 1)
    grads = DataParallel(ctx.module, ctx.dp_comm, int(ctx.parallel.bucket_mb * 2**20),
                         tracer=ctx.tracer, reduce_dtype=reduce_dtype, codec=codec)
    if not ctx.fresh:
        grads.broadcast_parameters()
    return grads, ReplicatedState(ctx.module, ctx.placement, ctx.dp_comm.rank,
                                  ctx.dp_comm.size)


def _build_zero(ctx: StrategyContext) -> tuple[GradSync, ShardedState]:
    wire = CAST_DTYPES.get(ctx.comm.codec, WIRE_DTYPES[ctx.parallel.grad_reduce_dtype])
    zero = ZeroDataParallel(ctx.units, ctx.dp_comm, ctx.parallel.zero, ctx.placement, wire,
                            gather_at_end=not ctx.fresh)
    if not ctx.fresh:
        zero.broadcast_parameters()
    return zero, zero


def _build_local(ctx: StrategyContext) -> tuple[GradSync, ShardedState]:
    grads = LocalGradients(ctx.module, ctx.dp_comm, broadcast=not ctx.fresh)
    return grads, ReplicatedState(ctx.module, ctx.placement, ctx.dp_comm.rank,
                                  ctx.dp_comm.size)


def _check_replica(name: str, wants_local: bool) -> Check:
    def check(config: Config, layout: Layout) -> None:
        if config.parallel.zero:
            raise ConfigError("parallel.zero", config.parallel.zero,
                              f"shards the state, which parallel.strategy={name} keeps "
                              "whole", "set parallel.strategy=auto or zero")
        if (config.train.sync != SYNC_EVERY_STEP) != wants_local:
            raise ConfigError("parallel.strategy", name,
                              f"does not fit train.sync={config.train.sync}",
                              "set parallel.strategy=auto")
    return check


register_strategy("ddp", _build_ddp, _check_replica("ddp", wants_local=False))
register_strategy("zero", _build_zero, check_zero, allocates=True)
register_strategy("local", _build_local, _check_replica("local", wants_local=True))
