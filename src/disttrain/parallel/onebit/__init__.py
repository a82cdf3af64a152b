"""1-bit Adam (``train.optimizer = onebit_adam``): the optimizer, its momentum
exchange, and the gradient side that stays local once the variance is frozen."""

from .adam import OnebitAdam, freeze_step_for
from .exchange import MomentumExchange
from .grads import OnebitGrads

__all__ = ["MomentumExchange", "OnebitAdam", "OnebitGrads", "freeze_step_for"]
