"""1-bit Adam (Tang et al., 2021): dense AdamW for a warmup, then a frozen variance and
the momentum averaged over the dp group in sign bits.

Adam's update is not linear in the gradient (the variance divides it), which is why a
compressed gradient hurts it; with the variance frozen the update is momentum SGD with a
fixed per-coordinate step, and a compressed momentum with error feedback loses nothing,
only delays it. The phases, counted in optimizer steps taken:

- ``step < freeze_step``: the gradients arrive all-reduced (the dp strategy runs as
  usual) and this is AdamW exactly: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2)
  g^2``, ``p -= lr (wd p + m_hat / (sqrt(v_hat) + eps))`` with bias corrections;
- after: each rank's gradient stays local (:class:`~.grads.OnebitGrads` skips the
  all-reduce; ``.grad`` holds this rank's estimate of the global gradient, dp x its
  share), ``m_r = b1 m + (1 - b1) g_r`` is averaged by the
  :class:`~.exchange.MomentumExchange` (worker and server error feedback) in units of
  the frozen step size ``sqrt(v_hat) + eps`` (see :meth:`OnebitAdam._exchange_momentum`),
  the result becomes ``m`` on every rank, and ``v`` stays as it was at the freeze (its
  bias correction too).

State per parameter: ``exp_avg``, ``exp_avg_sq``, ``step`` (as torch's AdamW keeps
them, so a checkpoint reads like one), and from the freeze on two residuals kept outside
``optimizer.state``: ``worker_error`` (parameter-shaped, different on every dp rank)
and ``server_error`` (the chunk of the parameter this rank serves). The dp strategy's
state saves them (:meth:`rank_state`, :meth:`range_state`) and loads them back into any
dp size: a worker residual from another dp size is replaced by the mean of the saved
ones (what the ranks owed in total is kept), the server residual is cut by element.
"""

from __future__ import annotations

import math

import torch

from ...comm.collectives import Communicator
from .exchange import MomentumExchange

WORKER_ERROR, SERVER_ERROR = "worker_error", "server_error"


def freeze_step_for(freeze_step: int, steps: int) -> int:
    """``train.freeze_step``, or with 0 the default: 15% of the run, at least 1 step (the
    variance must have seen gradients before it is frozen)."""
    return freeze_step if freeze_step > 0 else max(1, round(0.15 * steps))


class OnebitAdam(torch.optim.Optimizer):
    """AdamW that compresses its momentum exchange over ``comm`` (the dp group) to 1 bit
    per element after ``freeze_step`` steps; see the module docstring."""

    rank_keys = (WORKER_ERROR,)
    range_keys = (SERVER_ERROR,)

    def __init__(self, params, comm: Communicator, *, freeze_step: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1, got {freeze_step}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.comm, self.freeze_step = comm, freeze_step
        self.exchange = MomentumExchange(comm)
        self.worker_error: dict[torch.Tensor, torch.Tensor] = {}
        self.server_error: dict[torch.Tensor, torch.Tensor] = {}

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied so far (every parameter steps together)."""
        for p in self._params():
            step = self.state.get(p, {}).get("step")
            if step is not None:
                return int(step)
        return 0

    @property
    def compressing(self) -> bool:
        """Whether the next step is a compressed one (gradients must stay local)."""
        return self.steps_taken >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None if closure is None else closure()
        compress = self.compressing
        if compress:
            self._exchange_momentum()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if not compress and p.grad is None:
                    continue
                state = self._state(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if not compress:
                    g = p.grad
                    m.lerp_(g, 1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                state["step"] += 1
                t = int(state["step"])
                bc1 = 1 - beta1 ** t
                bc2_sqrt = math.sqrt(1 - beta2 ** min(t, self.freeze_step))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v.sqrt() / bc2_sqrt).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / bc1)
        return loss

    def _exchange_momentum(self) -> None:
        """m = the 1-bit average over ranks of b1 m + (1 - b1) g (this rank's g), taken
        in units of each element's frozen step size: what is compressed is the momentum
        divided by d = sqrt(v_hat) + eps (the same fixed d on every rank, so the average
        and the residuals carry over exactly), i.e. the update direction itself. With
        the raw momentum, an element whose variance is tiny would get its chunk's mean
        |m| and then be divided by its own small d: a step far larger than Adam ever
        takes."""
        params, xs, denoms = [], [], []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            bc2_sqrt = math.sqrt(1 - group["betas"][1] ** self.freeze_step)
            for p in group["params"]:
                state = self._state(p)
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                d = (state["exp_avg_sq"].sqrt() / bc2_sqrt).add_(group["eps"])
                params.append(p)
                denoms.append(d)
                xs.append(torch.lerp(state["exp_avg"], g.to(d.dtype), 1 - beta1)
                          .div_(d).reshape(-1))
        workers = [self._worker(p) for p in params]
        servers = [self._server(p) for p in params]
        averaged = self.exchange.average(xs, workers, servers)
        for p, u, d in zip(params, averaged, denoms):
            self.state[p]["exp_avg"].copy_(u.view(p.shape).mul_(d))

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32),
                         exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        return state

    def _worker(self, p: torch.Tensor) -> torch.Tensor:
        if p not in self.worker_error:
            self.worker_error[p] = torch.zeros(p.numel(), device=p.device)
        return self.worker_error[p]

    def _server(self, p: torch.Tensor) -> torch.Tensor:
        if p not in self.server_error:
            self.server_error[p] = torch.zeros(self.exchange.server_size(p.numel()),
                                               device=p.device)
        return self.server_error[p]

    # ------------------------------------------------------------ checkpointing
    def rank_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter-shaped state that differs on every dp rank (saved per rank)."""
        e = self.worker_error.get(p)
        return {} if e is None else {WORKER_ERROR: e.view(p.shape)}

    def range_state(self, p: torch.Tensor) -> dict[str, tuple[int, int, torch.Tensor]]:
        """State this rank holds for elements [start, stop) of ``p``'s flattening."""
        e = self.server_error.get(p)
        if e is None:
            return {}
        start, stop = self.exchange.chunk(p.numel())
        return {SERVER_ERROR: (start, stop, e[:stop - start])}

    def load_rank_state(self, p: torch.Tensor, key: str, value: torch.Tensor) -> None:
        """``value``: this rank's worker residual, parameter-shaped."""
        self._worker(p).copy_(value.reshape(-1))

    def load_range_state(self, p: torch.Tensor, key: str, full: torch.Tensor) -> None:
        """``full``: the server residual of the whole (local) parameter; this rank keeps
        the chunk it serves."""
        start, stop = self.exchange.chunk(p.numel())
        e = self._server(p)
        e.zero_()
        e[:stop - start].copy_(full.reshape(-1)[start:stop])

    def residual_bytes(self) -> int:
        """Bytes of the error-feedback residuals this rank holds."""
        return sum(e.numel() * e.element_size()
                   for d in (self.worker_error, self.server_error) for e in d.values())

    def comm_stats(self) -> dict[str, float]:
        """The last momentum exchange, in the gradient sync's metric names."""
        s = self.exchange.stats
        return {"grad_sync_bytes": s.payload,
                "compression_ratio": s.dense_payload / s.payload if s.payload else 1.0,
                "grad_sync_wire_bytes": s.wire_sent,
                "wire_compression_ratio": s.dense_wire / s.wire_sent if s.wire_sent else 1.0}
