"""Optimizers and the learning-rate schedule (linear warmup, then decay).

LARS and LAMB are the large-batch optimizers: each weight matrix's step is rescaled by a
layer-wise trust ratio ||w|| / ||update||, so every layer moves by a similar fraction
of its norm whatever its gradient scale. Parameters with dim < 2 (biases, norm gains)
get no trust ratio (and, from :func:`build_optimizer`, no weight decay).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..config.schema import TrainConfig
from ..parallel.onebit import OnebitAdam, freeze_step_for


def build_optimizer(model: nn.Module, train: TrainConfig, lr: float,
                    groups: list[dict] | None = None,
                    dp: Communicator | None = None) -> torch.optim.Optimizer:
    """AdamW, SGD, LARS, LAMB or 1-bit Adam. Weight decay applies to matrices (dim >= 2)
    only, not to biases and norm gains. ``groups`` replaces the model's parameters (the
    composed state's optimizer groups, e.g. ZeRO's shards; validation keeps lars/lamb
    away from flat shards); ``dp``: the group 1-bit Adam averages its momentum over."""
    if groups is None:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": train.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=train.momentum)
    if train.optimizer == "lars":
        return LARS(groups, lr=lr, momentum=train.momentum,
                    trust_coefficient=train.trust_coefficient)
    if train.optimizer == "lamb":
        return LAMB(groups, lr=lr, betas=(train.beta1, train.beta2))
    if train.optimizer == "onebit_adam":
        if dp is None:
            raise ValueError("onebit_adam averages its momentum over a dp group: pass dp")
        return OnebitAdam(groups, dp,
                          freeze_step=freeze_step_for(train.freeze_step, train.steps),
                          lr=lr, betas=(train.beta1, train.beta2))
    # on a GPU, one fused kernel per step instead of a dozen multi-tensor launches
    params = [p for g in groups for p in g["params"]]
    fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(groups, lr=lr, betas=(train.beta1, train.beta2), fused=fused)


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


def trust_ratio(weight: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """||weight|| / ||update|| as a 0-dim tensor; 1 when either norm is zero (a fresh
    zero-initialised layer, or nothing to do)."""
    w, u = torch.linalg.vector_norm(weight), torch.linalg.vector_norm(update)
    return torch.where((w > 0) & (u > 0), w / u.clamp(min=1e-30), torch.ones_like(w))


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling (You et al., 2017) on momentum SGD.

    For each parameter p with gradient g: u = g + weight_decay * p; for dim >= 2,
    u *= trust_coefficient * ||p|| / ||u||; then v = momentum * v + u and
    p -= lr * v. Parameters with dim < 2 take the plain momentum-SGD step on u.
    """

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum,
                                  "weight_decay": weight_decay,
                                  "trust_coefficient": trust_coefficient})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad.add(p, alpha=group["weight_decay"])
                if p.dim() >= 2:
                    update.mul_(group["trust_coefficient"] * trust_ratio(p, update))
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"].mul_(group["momentum"]).add_(update)
                p.sub_(buf, alpha=group["lr"])
        return loss


class LAMB(torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al., 2019): Adam moments with bias correction,
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p; for dim >= 2,
    p -= lr * (||p|| / ||u||) * u, otherwise p -= lr * u."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t = float(state["step"])
                m = state["exp_avg"].lerp_(p.grad, 1 - beta1)
                v = state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (v / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
                update = (m / (1 - beta1 ** t)).div_(denom).add_(p, alpha=group["weight_decay"])
                if p.dim() >= 2:
                    update.mul_(trust_ratio(p, update))
                p.sub_(update, alpha=group["lr"])
        return loss
