"""Every strategy by name, one registry per config key, all registered the same way.

    register_strategy("mine", build=lambda ctx: (MyGrads(ctx), MyState(ctx)))
    register_sync_mode(SyncMode("gossip", build=lambda ctx: Gossip(ctx)))
    register_optimizer(OptimizerKind("adafactor", build=lambda ctx: Adafactor(ctx.groups)))
    Trainer(model, data, loss, {"parallel": {"strategy": "mine"}}).fit()

A strategy lives in its own folder or module, which exports its entry (its builder and
its config check, see :mod:`.strategy`); the built-ins are registered at the end of this
module. Validation runs the check of each entry the config selects
(:func:`selected_entries`), the composition calls their builders; nothing else needs to
know which one was chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from ..config.layout import Layout
from ..config.schema import Config
from ..errors import ConfigError
from .ddp import DDP
from .onebit import ONEBIT_ADAM
from .optimizers import BUILTIN_OPTIMIZERS
from .strategy import (
    Check,
    DataParallelStrategy,
    OptimizerKind,
    StrategyContext,
    SyncMode,
    no_check,
    selected_strategy,
)
from .sync import LOCAL, SYNC_MODES_BUILTIN
from .zero import ZERO


class _Entry(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def check(self) -> Check: ...


E = TypeVar("E", bound=_Entry)


class Registry(Generic[E]):
    """The entries one config key (``key``) chooses among; ``how``: the function a user
    calls to add one (named in the error for an unknown choice)."""

    def __init__(self, key: str, how: str) -> None:
        self.key, self.how = key, how
        self._entries: dict[str, E] = {}

    def register(self, entry: E) -> None:
        self._entries[entry.name] = entry

    def names(self) -> list[str]:
        """In the order registered (the built-ins first)."""
        return list(self._entries)

    def get(self, name: str) -> E:
        if name not in self._entries:
            raise ConfigError(self.key, name, "is not a registered choice",
                              f"use one of {', '.join(self.names())} (or call "
                              f"disttrain.parallel.{self.how} first)")
        return self._entries[name]


# the registered choices of each key (the names a key accepts: names.py's tuples hold
# the built-ins' names, these the entries, user-registered ones included)
STRATEGY_REGISTRY: Registry[DataParallelStrategy] = Registry("parallel.strategy",
                                                             "register_strategy")
SYNC_MODE_REGISTRY: Registry[SyncMode] = Registry("train.sync", "register_sync_mode")
OPTIMIZER_REGISTRY: Registry[OptimizerKind] = Registry("train.optimizer", "register_optimizer")


def register_strategy(name: str, build: Callable[[StrategyContext], tuple],
                      check: Check = no_check, *, allocates: bool = False) -> None:
    """Make ``parallel.strategy = name`` build this rank's gradient sync and state with
    ``build``; ``check`` refuses configurations it cannot train, before launch;
    ``allocates``: ``build`` gives meta parameters their storage (see
    :class:`~.strategy.StrategyContext`)."""
    STRATEGY_REGISTRY.register(DataParallelStrategy(name, build, check, allocates))


def register_sync_mode(mode: SyncMode) -> None:
    """Make ``train.sync = mode.name`` run ``mode.build(ctx)`` between steps."""
    SYNC_MODE_REGISTRY.register(mode)


def register_optimizer(kind: OptimizerKind) -> None:
    """Make ``train.optimizer = kind.name`` build ``kind.build(ctx)``."""
    OPTIMIZER_REGISTRY.register(kind)


def strategy_names() -> list[str]:
    """The registered data-parallel strategy names (``parallel.strategy``), sorted."""
    return sorted(STRATEGY_REGISTRY.names())


def get_strategy(config: Config) -> DataParallelStrategy:
    return STRATEGY_REGISTRY.get(selected_strategy(config))


def selected_entries(config: Config) -> list[DataParallelStrategy | SyncMode | OptimizerKind]:
    """The sync mode, data-parallel strategy and optimizer ``config`` selects (an unknown
    name is refused naming its key)."""
    return [SYNC_MODE_REGISTRY.get(config.train.sync), get_strategy(config),
            OPTIMIZER_REGISTRY.get(config.train.optimizer)]


def check_selected(config: Config, layout: Layout) -> None:
    """Each selected entry's own check, in that order."""
    for entry in selected_entries(config):
        entry.check(config, layout)


for _strategy in (DDP, ZERO, LOCAL):
    STRATEGY_REGISTRY.register(_strategy)
for _mode in SYNC_MODES_BUILTIN:
    SYNC_MODE_REGISTRY.register(_mode)
for _kind in (*BUILTIN_OPTIMIZERS, ONEBIT_ADAM):
    OPTIMIZER_REGISTRY.register(_kind)
