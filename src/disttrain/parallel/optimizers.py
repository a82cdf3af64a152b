"""The optimizers that exchange nothing themselves: AdamW, SGD, LARS and LAMB, as
registry entries (``train.optimizer``). Weight decay is set per parameter group by the
composed state (matrices decayed, biases and norm gains not)."""

from __future__ import annotations

import torch

from ..config.layout import Layout
from ..config.schema import Config
from ..errors import ConfigError
from ..optim import LAMB, LARS
from .strategy import OptimizerContext, OptimizerKind


def _adamw(ctx: OptimizerContext) -> torch.optim.Optimizer:
    # on a GPU, one fused kernel per step instead of a dozen multi-tensor launches
    params = [p for g in ctx.groups for p in g["params"]]
    fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(ctx.groups, lr=ctx.lr, betas=(ctx.train.beta1, ctx.train.beta2),
                             fused=fused)


def _sgd(ctx: OptimizerContext) -> torch.optim.Optimizer:
    return torch.optim.SGD(ctx.groups, lr=ctx.lr, momentum=ctx.train.momentum)


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


BUILTIN_OPTIMIZERS = (OptimizerKind("adamw", _adamw), OptimizerKind("sgd", _sgd),
                      OptimizerKind("lars", _lars, check_layerwise),
                      OptimizerKind("lamb", _lamb, check_layerwise))
