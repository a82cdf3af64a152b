"""The learning-rate schedule (linear warmup, then decay), and an optimizer for a
plain model (the one ``train.optimizer`` names, from :mod:`disttrain.parallel.registry`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..config.schema import TrainConfig
from ..optim import decay_groups
from ..parallel.registry import OPTIMIZER_REGISTRY
from ..parallel.strategy import OptimizerContext


def build_optimizer(model: nn.Module, train: TrainConfig, lr: float,
                    groups: list[dict] | None = None,
                    replicas: Communicator | None = None) -> torch.optim.Optimizer:
    """The optimizer ``train.optimizer`` names over ``model``'s parameters (weight decay
    on matrices, dim >= 2, only), or over ``groups`` (a composed state's optimizer
    groups); ``replicas``: the group an optimizer that communicates uses."""
    if groups is None:
        groups = decay_groups((p for p in model.parameters() if p.requires_grad),
                              train.weight_decay)
    return OPTIMIZER_REGISTRY.get(train.optimizer).build(
        OptimizerContext(groups=groups, lr=lr, train=train, replicas=replicas))


def lr_at(step: int, train: TrainConfig, peak_lr: float) -> float:
    """LR for optimizer step ``step`` (0-based): warmup reaches the peak at the end of
    ``warmup_steps``, then cosine/linear decay to ``min_lr_ratio * peak`` at the last step."""
    if step < train.warmup_steps:
        return peak_lr * (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return peak_lr
    span = max(1, train.steps - 1 - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    if train.schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    floor = train.min_lr_ratio
    return peak_lr * (floor + (1.0 - floor) * shape)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """``optimizer.step()`` gated on ``skip`` (0-dim, nonzero: a nan / inf in the step),
    decided on the device: an optimizer that takes the flag (torch's fused AdamW and
    SGD, disttrain's LARS / LAMB / 1-bit Adam: ``_step_supports_amp_scaling``, reading
    ``optimizer.found_inf`` as torch's GradScaler sets it) leaves parameters and state
    exactly as they were; any other optimizer reads the flag on the host first."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        found_inf = skip.float().reshape(())
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    elif not bool(skip):
        optimizer.step()
