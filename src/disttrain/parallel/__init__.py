"""The strategies, one folder or module each, and the composition that fits them together.

    parallelized = compose(model, spec, config, topology, groups, ...)
    parallelized.grads   # GradSync: the loop's gradient side
    parallelized.state   # ShardedState: what this rank saves and loads

A new data-parallel strategy implements the two protocols of :mod:`.interfaces` and
registers itself with :func:`register_strategy`; a sync mode
(:func:`register_sync_mode`) and an optimizer (:func:`register_optimizer`) register the
same way (:mod:`.registry`).
"""

from .compose import Groups, Parallelized, compose
from .interfaces import GradSync, ShardedState, SyncStrategy, TensorSource
from .placement import Placement, StatePiece
from .registry import register_optimizer, register_strategy, register_sync_mode, strategy_names
from .strategy import OptimizerContext, OptimizerKind, StrategyContext, SyncContext, SyncMode

__all__ = ["GradSync", "Groups", "OptimizerContext", "OptimizerKind", "Parallelized",
           "Placement", "ShardedState", "StatePiece", "StrategyContext", "SyncContext",
           "SyncMode", "SyncStrategy", "TensorSource", "compose", "register_optimizer",
           "register_strategy", "register_sync_mode", "strategy_names"]
