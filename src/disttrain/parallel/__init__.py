"""The strategies, one folder or module each, and the composition that fits them together.

    parallelized = compose(model, spec, config, topology, groups, ...)
    parallelized.grads   # GradSync: the loop's gradient side
    parallelized.state   # ShardedState: what this rank saves and loads

A new data-parallel strategy implements the two protocols of :mod:`.interfaces` and
registers itself with :func:`register_strategy`.
"""

from .compose import Groups, Parallelized, compose
from .interfaces import GradSync, ShardedState, StatePiece, TensorSource
from .placement import Placement
from .registry import StrategyContext, register_strategy, strategy_names

__all__ = ["GradSync", "Groups", "Parallelized", "Placement", "ShardedState", "StatePiece",
           "StrategyContext", "TensorSource", "compose", "register_strategy",
           "strategy_names"]
