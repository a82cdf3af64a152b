"""Optimizers and the learning-rate schedule (linear warmup, then decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config.schema import TrainConfig


def build_optimizer(model: nn.Module, train: TrainConfig, lr: float,
                    groups: list[dict] | None = None) -> torch.optim.Optimizer:
    """AdamW or SGD. Weight decay applies to matrices (dim >= 2) only, not to biases
    and norm gains. ``groups`` replaces the model's parameters (ZeRO's shards)."""
    if groups is None:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": train.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=train.momentum)
    return torch.optim.AdamW(groups, lr=lr, betas=(train.beta1, train.beta2))


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
