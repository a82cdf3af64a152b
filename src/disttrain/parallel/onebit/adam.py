"""1-bit Adam (Tang et al., 2021): dense AdamW for ``freeze_step`` steps, then a frozen
variance and the momentum averaged over the dp group in sign bits.

Adam's update is not linear in the gradient (the variance divides it), so a compressed
gradient hurts it; with the variance frozen the update is momentum SGD with a fixed
per-coordinate step, and a compressed momentum with error feedback loses nothing, only
delays it. The phases, the ZeRO-1 form, the state and the figures:
``docs/strategies/onebit-adam.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import overload

import torch
from torch.optim.optimizer import ParamsT

from ...comm.collectives import Communicator
from .exchange import BucketLayout, MomentumExchange

WORKER_ERROR, SERVER_ERROR = "worker_error", "server_error"


@dataclass(frozen=True)
class FlatShard:
    """A ZeRO-1 flat buffer as 1-bit Adam sees it: the optimizer's parameter is this
    rank's shard, a slice of ``full``."""

    full: torch.Tensor  # [padded] the whole buffer, held by every dp rank
    grad: torch.Tensor  # [padded] this rank's whole local gradient
    numel: int  # real elements (the rest of ``full`` is padding)


@dataclass
class _Bucket:
    """Parameters whose momentum travels together (one set of betas and eps), in group
    order; their layout in the exchange, and their residuals, which the per-parameter
    entries of ``worker_error`` / ``server_error`` (``optimizer.state`` under ZeRO-1)
    view: ``carry`` [layout.numel] as the parameters concatenate, ``server``
    [layout.columns] this rank's row of each one's chunk."""

    params: list[torch.Tensor]
    beta1: float
    beta2: float
    eps: float
    layout: BucketLayout
    carry: torch.Tensor
    server: torch.Tensor
    # the frozen step sizes [layout.numel] and the variances they came from (computed
    # again only when a checkpoint replaced one)
    denom: torch.Tensor | None = None
    denom_of: tuple[torch.Tensor, ...] = ()


def freeze_step_for(freeze_step: int, steps: int) -> int:
    """``train.freeze_step``, or with 0 the default: 15% of the run, at least 1 step (the
    variance must have seen gradients before it is frozen)."""
    return freeze_step if freeze_step > 0 else max(1, round(0.15 * steps))


class OnebitAdam(torch.optim.Optimizer):
    """AdamW that compresses its momentum exchange over ``comm`` (the dp group) to 1 bit
    per element after ``freeze_step`` steps.

    Before: AdamW exactly, on all-reduced gradients. After, in units of the frozen step
    size ``d = sqrt(v_hat) + eps`` (the same on every rank), a round per rank::

        x  = (1 - b1) g_rank / d + c     (c: the carry, b1 m / d at the freeze)
        u  = exchange(x)                 (the same decoded direction on every rank)
        c  = (x - what the rank sent of x) + b1 u
        p -= lr (wd p + u / bc1)         (exp_avg kept = u d, as AdamW reads it)

    bucket by bucket (``bucket_bytes`` of fp32, in group order). State per parameter:
    AdamW's, the carry ``worker_error`` (per dp rank, outside ``optimizer.state``) and
    the server residual ``server_error`` (the run this rank serves)."""

    rank_keys = (WORKER_ERROR,)
    range_keys = (SERVER_ERROR,)

    def __init__(self, params: ParamsT, comm: Communicator, *, freeze_step: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bucket_bytes: int = 25 * 2**20) -> None:
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1, got {freeze_step}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.comm, self.freeze_step, self.bucket_bytes = comm, freeze_step, bucket_bytes
        self.exchange = MomentumExchange(comm)
        self.worker_error: dict[torch.Tensor, torch.Tensor] = {}
        self.server_error: dict[torch.Tensor, torch.Tensor] = {}
        self.flats: dict[torch.Tensor, FlatShard] = {}  # ZeRO-1: shard -> its buffer
        # ZeRO-1: shard -> (the exp_avg_sq it was built from, the whole frozen d)
        self._denoms: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._buckets: list[_Bucket] = []  # cut at the first compressed step
        # takes the step's non-finite flag (``found_inf``, torch's convention); its phase
        # is counted on the host, so it reads that flag there (one read per step)
        self._step_supports_amp_scaling = True

    def shard_over(self, flats: dict[torch.Tensor, FlatShard]) -> None:
        """ZeRO-1: every parameter is this rank's shard of one of ``flats``, and its owner
        is its server: ``m``, ``v`` and the server residual are kept for the shard only,
        ``d`` is all-gathered once into a whole copy, and every rank applies the same
        decoded direction to its whole copy of the buffer (no dense parameter
        all-gather follows)."""
        params = set(self._params())
        if set(flats) != params:
            raise ValueError("shard_over needs a flat buffer for every parameter")
        for shard, flat in flats.items():
            lo = self.comm.rank * shard.numel()
            if flat.full.numel() != self.comm.size * shard.numel() or \
                    shard.data_ptr() != flat.full[lo:].data_ptr():
                raise ValueError("a ZeRO-1 shard must be its rank's slice of the buffer")
        self.flats = dict(flats)

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

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None if closure is None else closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # the same on every dp rank
            return loss
        if self.compressing:
            self._apply(self._exchange())
            return loss
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                t = int(state["step"])
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1 ** t))
        return loss

    def _apply(self, directions: dict[torch.Tensor, torch.Tensor]) -> None:
        """Every rank applies the same decoded ``directions`` to each parameter, or under
        ZeRO-1 to its whole copy of the shard's buffer (a few multi-tensor operations
        per group)."""
        for group in self.param_groups:
            params = group["params"]
            steps = [self._state(p)["step"] for p in params]
            if not steps:
                continue
            torch._foreach_add_(steps, 1)
            wholes: list[torch.Tensor] = []
            moves: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for p, step in zip(params, steps, strict=True):
                flat = self.flats.get(p)
                wholes.append(p if flat is None else flat.full)
                moved = p if flat is None else flat.full[:flat.numel]
                bc1 = 1 - group["betas"][0] ** int(step)
                targets, us = moves.setdefault(bc1, ([], []))
                targets.append(moved)
                us.append(directions[p].view_as(moved))
            decay = 1 - group["lr"] * group["weight_decay"]
            if decay != 1.0:
                torch._foreach_mul_(wholes, decay)
            for bc1, (targets, us) in moves.items():
                torch._foreach_add_(targets, us, alpha=-group["lr"] / bc1)

    def _exchange(self) -> dict[torch.Tensor, torch.Tensor]:
        """One compressed round (the class docstring), bucket by bucket: each parameter's
        decoded direction ``u`` [n] (a ZeRO-1 shard's: over its whole buffer); the
        worker carries, server residuals and ``exp_avg`` (= u d) updated. Every
        bucket's all-to-all is started before the first one is finished."""
        self.exchange.new_round()
        if not self._buckets:
            self._buckets = self._make_buckets()
        started = []
        for b in self._buckets:
            d = self._bucket_denominator(b)
            self._adopt_residuals(b, d)
            started.append((d, self.exchange.start(b.layout, self._bucket_input(b, d),
                                                   b.carry)))
        out: dict[torch.Tensor, torch.Tensor] = {}
        for b, (d, pending) in zip(self._buckets, started, strict=True):
            u = self.exchange.finish(pending, b.server)
            b.carry.add_(u, alpha=b.beta1)  # b1 u goes into the next round
            m_all = u * d
            replicas, copies = [], []
            for i, p in enumerate(b.params):
                lo, n = b.layout.starts[i], b.layout.layouts[i].numel
                m = self.state[p]["exp_avg"]
                if p in self.flats:  # this rank's shard of m = u d
                    a, z = b.layout.served(i)
                    m[:z - a].copy_(m_all[lo + a:lo + z])
                else:
                    replicas.append(m)
                    copies.append(m_all[lo:lo + n].view(p.shape))
                out[p] = u[lo:lo + n]
            if replicas:
                torch._foreach_copy_(replicas, copies)
        return out

    def _make_buckets(self) -> list[_Bucket]:
        """The parameters in group order, cut into buckets of at most ``bucket_bytes``
        of fp32 (a bigger parameter gets its own), never mixing betas or eps."""
        cuts: list[tuple[tuple, list[torch.Tensor], list[int]]] = []
        size = 0
        for group in self.param_groups:
            key = (*group["betas"], group["eps"])
            for p in group["params"]:
                n = self.flats[p].numel if p in self.flats else p.numel()
                if not cuts or cuts[-1][0] != key or size + 4 * n > self.bucket_bytes:
                    cuts.append((key, [], []))
                    size = 0
                cuts[-1][1].append(p)
                cuts[-1][2].append(n)
                size += 4 * n
        buckets = []
        for (beta1, beta2, eps), params, numels in cuts:
            strides = [p.numel() if p in self.flats else None for p in params]
            layout = self.exchange.layout(numels, strides)
            device = params[0].device
            buckets.append(_Bucket(params, beta1, beta2, eps, layout,
                                   torch.zeros(layout.numel, device=device),
                                   torch.zeros(layout.columns, device=device)))
        return buckets

    def _bucket_denominator(self, b: _Bucket) -> torch.Tensor:
        """The frozen step sizes ``sqrt(v_hat) + eps`` of the bucket's parameters
        concatenated [numel] (ZeRO-1: over each shard's whole buffer)."""
        if b.params[0] in self.flats:
            return torch.cat([self._denominator(p, b.eps, b.beta2) for p in b.params])
        vs = tuple(self.state[p]["exp_avg_sq"] for p in b.params)
        if b.denom is None or any(v is not w for v, w in zip(vs, b.denom_of, strict=True)):
            v = torch.cat([v.reshape(-1) for v in vs])
            bc2_sqrt = math.sqrt(1 - b.beta2 ** self.freeze_step)
            b.denom, b.denom_of = v.sqrt_().div_(bc2_sqrt).add_(b.eps), vs
        return b.denom

    def _bucket_input(self, b: _Bucket, d: torch.Tensor) -> torch.Tensor:
        """``(1 - b1) g / d`` of the bucket's parameters, concatenated [numel] (a
        parameter without a gradient contributes zeros)."""
        grads = []
        for p in b.params:
            flat = self.flats.get(p)
            if flat is not None:
                grads.append(flat.grad[:flat.numel])
            elif p.grad is not None:
                grads.append(p.grad.reshape(-1))
            else:
                grads.append(torch.zeros(p.numel(), device=d.device))
        return torch.cat(grads).to(d.dtype).mul_(1 - b.beta1).div_(d)

    def _adopt_residuals(self, b: _Bucket, d: torch.Tensor) -> None:
        """Make each parameter's worker carry and server residual the bucket's views,
        copying in what a checkpoint loaded since (or the carry the freeze creates)."""
        for i, p in enumerate(b.params):
            lo, n = b.layout.starts[i], b.layout.layouts[i].numel
            view = b.carry[lo:lo + n]
            carry = self.worker_error.get(p)
            if carry is None:
                carry = self._carry(p, d[lo:lo + n], b.beta1)
            if carry.data_ptr() != view.data_ptr():
                view.copy_(carry.reshape(-1))
                self.worker_error[p] = view
            col = b.layout.offsets[i]
            if p in self.flats:  # beside exp_avg in optimizer.state, shard-shaped
                state = self.state[p]
                server = b.server[col:col + p.numel()].view(p.shape)
                held = state.get(SERVER_ERROR)
                if held is None or held.data_ptr() != server.data_ptr():
                    server.copy_(held) if held is not None else server.zero_()
                    state[SERVER_ERROR] = server
            else:
                server = b.server[col:col + b.layout.layouts[i].chunk]
                held = self._server(p)
                if held.data_ptr() != server.data_ptr():
                    server.copy_(held)
                    self.server_error[p] = server

    def _denominator(self, p: torch.Tensor, eps: float, beta2: float) -> torch.Tensor:
        """ZeRO-1: the frozen step size ``sqrt(v_hat) + eps`` over the shard's whole
        buffer [n], all-gathered from the shards once (again after a checkpoint replaced
        the variance)."""
        v = self.state[p]["exp_avg_sq"]
        flat = self.flats[p]
        cached = self._denoms.get(p)
        if cached is None or cached[0] is not v:
            d = (v.sqrt() / math.sqrt(1 - beta2 ** self.freeze_step)).add_(eps)
            full = torch.empty(self.comm.size * d.numel(), dtype=d.dtype, device=d.device)
            self.comm.all_gather_into(full, d)
            self._denoms[p] = cached = (v, full[:flat.numel])
        return cached[1]

    def _carry(self, p: torch.Tensor, d: torch.Tensor, beta1: float) -> torch.Tensor:
        """``p``'s worker carry at the first compressed step (flat, [n] of its buffer
        under ZeRO-1): ``b1 m / d`` from the warmup's momentum (under ZeRO-1 the shards
        of ``m / d`` all-gathered)."""
        m, flat = self.state[p]["exp_avg"], self.flats.get(p)
        if flat is None:
            carry = m.reshape(-1) / d
        else:
            lo, hi = self.exchange.chunk(flat.numel, p.numel())
            mine = torch.zeros_like(m)
            mine[:hi - lo] = m[:hi - lo] / d[lo:hi]
            carry = torch.empty(self.comm.size * m.numel(), dtype=m.dtype, device=m.device)
            self.comm.all_gather_into(carry, mine)
            carry = carry[:flat.numel].clone()
        return carry.mul_(beta1)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32),
                         exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        return state

    def _server(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s server residual: the run this rank serves (ZeRO-1: the shard's, in
        ``optimizer.state`` beside ``exp_avg``, so it is saved and cut like it)."""
        if p in self.flats:
            return self.state[p].setdefault(SERVER_ERROR, torch.zeros_like(p))
        if p not in self.server_error:
            self.server_error[p] = torch.zeros(self.exchange.server_size(p.numel()),
                                               device=p.device)
        return self.server_error[p]

    # ------------------------------------------------------------ checkpointing
    def rank_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """State that differs on every dp rank (saved per rank): parameter-shaped, or
        under ZeRO-1 flat over the shard's whole buffer."""
        e = self.worker_error.get(p)
        if e is None:
            return {}
        return {WORKER_ERROR: e if p in self.flats else e.view(p.shape)}

    def range_state(self, p: torch.Tensor) -> dict[str, tuple[int, int, torch.Tensor]]:
        """State this rank holds for elements [start, stop) of ``p``'s flattening
        (none under ZeRO-1: the server residual is in ``optimizer.state``)."""
        e = self.server_error.get(p)
        if e is None:
            return {}
        start, stop = self.exchange.chunk(p.numel())
        return {SERVER_ERROR: (start, stop, e[:stop - start])}

    def load_rank_state(self, p: torch.Tensor, key: str, value: torch.Tensor) -> None:
        """``value``: this rank's worker residual, parameter-shaped (ZeRO-1: flat over
        the shard's whole buffer)."""
        self.worker_error[p] = value.reshape(-1).to(p.device, torch.float32).clone()

    def load_range_state(self, p: torch.Tensor, key: str, full: torch.Tensor) -> None:
        """``full``: the server residual of the whole (local) parameter; this rank keeps
        the chunk it serves."""
        start, stop = self.exchange.chunk(p.numel())
        e = self._server(p)
        e.zero_()
        e[:stop - start].copy_(full.reshape(-1)[start:stop])

    def residual_bytes(self) -> int:
        """Bytes this rank holds outside ``optimizer.state``: the error-feedback
        residuals, and under ZeRO-1 the whole frozen step sizes."""
        tensors = [*self.worker_error.values(), *self.server_error.values(),
                   *(d for _, d in self._denoms.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def comm_stats(self) -> dict[str, float]:
        """The last momentum exchange, in the gradient sync's metric names."""
        s = self.exchange.stats
        return {"grad_sync_bytes": s.payload,
                "compression_ratio": s.dense_payload / s.payload if s.payload else 1.0,
                "grad_sync_wire_bytes": s.wire_sent,
                "wire_compression_ratio": s.dense_wire / s.wire_sent if s.wire_sent else 1.0}
