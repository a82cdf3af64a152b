"""The optimizers that exchange nothing themselves: AdamW, SGD, LARS and LAMB, as
registry entries (``train.optimizer``). Weight decay is set per parameter group by the
composed state (matrices decayed, biases and norm gains not)."""

from __future__ import annotations

import torch

from ..config.layout import Layout
from ..config.schema import Config
from ..errors import ConfigError
from ..names import OPTIMIZER_ADAMW, OPTIMIZER_LAMB, OPTIMIZER_LARS, OPTIMIZER_SGD
from ..optim import LAMB, LARS
from .strategy import OptimizerContext, OptimizerKind


def _adamw(ctx: OptimizerContext) -> torch.optim.Optimizer:
    # torch's fused kernel (CPU and GPU): one kernel per step instead of a dozen
    # multi-tensor launches, and it takes the step's non-finite flag on the device
    # (``found_inf``: a skipped step changes no parameter, moment or step count)
    return torch.optim.AdamW(ctx.groups, lr=ctx.lr, betas=(ctx.train.beta1, ctx.train.beta2),
                             fused=True)


def _sgd(ctx: OptimizerContext) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(ctx.groups, lr=ctx.lr, momentum=ctx.train.momentum,
                                fused=True)
    if ctx.train.momentum:
        # the fused kernel starts momentum buffers it finds missing from the first
        # gradient; a first step skipped on the device would leave them uninitialised.
        # Zeros give the same first step (0 x momentum + g = g, dampening 0).
        for p in (p for g in ctx.groups for p in g["params"]):
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def _lars(ctx: OptimizerContext) -> torch.optim.Optimizer:
    return LARS(ctx.groups, lr=ctx.lr, momentum=ctx.train.momentum,
                trust_coefficient=ctx.train.trust_coefficient)


def _lamb(ctx: OptimizerContext) -> torch.optim.Optimizer:
    return LAMB(ctx.groups, lr=ctx.lr, betas=(ctx.train.beta1, ctx.train.beta2))


def check_layerwise(config: Config, layout: Layout) -> None:
    """The trust ratio needs each layer's whole weight: ZeRO's flat shards cannot give
    it."""
    if config.parallel.zero:
        opt = config.train.optimizer
        raise ConfigError("train.optimizer", opt, f"is not supported with parallel.zero="
                          f"{config.parallel.zero} (the trust ratio needs each layer's "
                          "whole weight, ZeRO holds flat shards)", "use parallel.zero=0 "
                          "with lars/lamb, or train.optimizer=adamw/sgd with ZeRO")


BUILTIN_OPTIMIZERS = (OptimizerKind(OPTIMIZER_ADAMW, _adamw),
                      OptimizerKind(OPTIMIZER_SGD, _sgd),
                      OptimizerKind(OPTIMIZER_LARS, _lars, check_layerwise),
                      OptimizerKind(OPTIMIZER_LAMB, _lamb, check_layerwise))
