"""The large-batch optimizers: LARS and LAMB.

Each weight matrix's step is rescaled by a layer-wise trust ratio ||w|| / ||update||, so
every layer moves by a similar fraction of its norm whatever its gradient scale.
Parameters with dim < 2 (biases, norm gains) get no trust ratio.

Both take the step's non-finite flag on the device as torch's fused optimizers do
(``optimizer.found_inf``, a float tensor, nonzero: skip): a skipped step changes no
parameter and no state, and nothing is read on the host to decide it.
"""

from __future__ import annotations

import torch


def trust_ratio(weight: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """||weight|| / ||update|| as a 0-dim tensor; 1 when either norm is zero (a fresh
    zero-initialised layer, or nothing to do)."""
    w, u = torch.linalg.vector_norm(weight), torch.linalg.vector_norm(update)
    return torch.where((w > 0) & (u > 0), w / u.clamp(min=1e-30), torch.ones_like(w))


def _keep(found_inf: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor
          ) -> torch.Tensor:
    """``new``, or ``old`` where the step is skipped (``found_inf`` nonzero): chosen on
    the device, bit for bit ``new`` when it is not."""
    if found_inf is None:
        return new
    return torch.where(found_inf.to(old.device).reshape(()) != 0, old, new)


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
        self._step_supports_amp_scaling = True  # takes ``found_inf`` (torch's convention)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None if closure is None else closure()
        found_inf = getattr(self, "found_inf", None)
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
                old = state["momentum_buffer"]
                buf = old.mul(group["momentum"]).add_(update)
                p.copy_(_keep(found_inf, p, p.sub(buf, alpha=group["lr"])))
                old.copy_(_keep(found_inf, old, buf))
        return loss


class LAMB(torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al., 2019): Adam moments with bias correction,
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p; for dim >= 2,
    p -= lr * (||p|| / ||u||) * u, otherwise p -= lr * u."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self._step_supports_amp_scaling = True  # takes ``found_inf`` (torch's convention)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None if closure is None else closure()
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # the step count on the parameter's device: no host read
                    state.update(step=torch.zeros((), dtype=torch.float64, device=p.device),
                                 exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                step = state["step"].add(1)
                m = state["exp_avg"].lerp(p.grad, 1 - beta1)
                v = state["exp_avg_sq"].mul(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                # bias corrections 1 - beta^t in float64, then in the moments' dtype
                bc1 = (1 - torch.pow(beta1, step)).to(m.dtype)
                bc2 = (1 - torch.pow(beta2, step)).to(v.dtype)
                denom = (v / bc2).sqrt_().add_(group["eps"])
                update = (m / bc1).div_(denom).add_(p, alpha=group["weight_decay"])
                if p.dim() >= 2:
                    update.mul_(trust_ratio(p, update))
                p.copy_(_keep(found_inf, p, p.sub(update, alpha=group["lr"])))
                for key, new in (("step", step), ("exp_avg", m), ("exp_avg_sq", v)):
                    state[key].copy_(_keep(found_inf, state[key], new))
        return loss
