"""The large-batch optimizers: LARS and LAMB.

Each weight matrix's step is rescaled by a layer-wise trust ratio ||w|| / ||update||, so
every layer moves by a similar fraction of its norm whatever its gradient scale.
Parameters with dim < 2 (biases, norm gains) get no trust ratio.
"""

from __future__ import annotations

import torch


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
