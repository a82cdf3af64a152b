"""1-bit Adam (``train.optimizer = onebit_adam``): the optimizer, its momentum
exchange, and the gradient side that stays local once the variance is frozen.

:data:`ONEBIT_ADAM` is its registry entry: the optimizer, its check, and the gradient
side it wraps around the data-parallel strategy's.
"""

from __future__ import annotations

from ...names import OPTIMIZER_ONEBIT_ADAM
from ..strategy import OptimizerContext, OptimizerKind
from .adam import OnebitAdam, freeze_step_for
from .check import check_onebit
from .exchange import MomentumExchange
from .grads import OnebitGrads


def build_onebit_adam(ctx: OptimizerContext) -> OnebitAdam:
    """1-bit Adam over ``ctx.replicas`` (the group it averages its momentum over)."""
    if ctx.replicas is None:
        raise ValueError("onebit_adam averages its momentum over a dp group: pass replicas")
    t = ctx.train
    return OnebitAdam(ctx.groups, ctx.replicas,
                      freeze_step=freeze_step_for(t.freeze_step, t.steps), lr=ctx.lr,
                      betas=(t.beta1, t.beta2))


# its momentum exchange replaces the all-reduce once the variance is frozen
ONEBIT_ADAM = OptimizerKind(OPTIMIZER_ONEBIT_ADAM, build_onebit_adam, check_onebit,
                            wrap_grads=OnebitGrads)

__all__ = ["ONEBIT_ADAM", "MomentumExchange", "OnebitAdam", "OnebitGrads",
           "build_onebit_adam", "freeze_step_for"]
