"""The dp strategy's gradient side under 1-bit Adam: as usual during the warmup, local
once the optimizer compresses (its momentum exchange replaces the all-reduce)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ...comm.collectives import Communicator
from ..clipping import clip_to_global_norm, squared_norm
from ..grads import GradSyncOver
from ..interfaces import GradSync
from ..zero import ZeroDataParallel
from .adam import FlatShard, OnebitAdam


class OnebitGrads(GradSyncOver):
    """:class:`~disttrain.parallel.interfaces.GradSync` over ``inner`` (the ddp
    strategy's) that follows a :class:`~.adam.OnebitAdam`'s phase, decided at the start
    of each step (:meth:`zero_grad`):

    - warmup: every call goes to ``inner`` (gradients all-reduced);
    - compressed: backward passes accumulate without reducing; the loss totals are still
      summed over dp, so ``finish_gradient_sync(scale)`` leaves this rank's share of the
      global gradient times dp in ``.grad`` (its estimate of the global gradient: their
      mean over ranks is the global gradient); the norm is the root mean square of those
      estimates' norms over dp (one all-reduce of a scalar), the same on every rank, so
      every rank clips by the same factor and skips a non-finite step together.

    Over ZeRO-1 the local gradients are the whole ones stage 1 keeps
    (:meth:`~..zero.ZeroDataParallel.whole_gradients`), the optimizer updates every
    rank's whole copy of the parameters itself, and no parameter all-gather follows a
    local step.
    """

    def __init__(self, inner: GradSync, comm: Communicator) -> None:
        super().__init__(inner)
        self.comm = comm
        self.zero = inner if isinstance(inner, ZeroDataParallel) else None
        if self.zero is not None and self.zero.stage != 1:
            raise ValueError(f"1-bit Adam runs over ZeRO-1, not stage {self.zero.stage}")
        self.optimizer: OnebitAdam | None = None
        self.local = False
        self._held = contextlib.ExitStack()  # inner.no_sync() through a local step

    @property
    def grad_replicas(self) -> int:
        """During a local step every dp rank holds an estimate of the same gradient."""
        return self.comm.size if self.local else self.inner.grad_replicas

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the phase from ``optimizer`` (the trainer binds it once built); over
        ZeRO-1, hand it the flat buffers its shards belong to."""
        if not isinstance(optimizer, OnebitAdam):
            raise TypeError(f"OnebitGrads follows a OnebitAdam, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        if self.zero is not None:
            optimizer.shard_over({shard: FlatShard(full=full, grad=grad, numel=numel)
                                  for shard, full, grad, numel in self.zero.whole_flats()})

    def _local_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, this rank's own whole gradient) during a local step."""
        if self.zero is not None:
            return self.zero.whole_gradients()
        return self.inner.gradient_pieces()

    def zero_grad(self) -> None:
        self._held.close()
        self.inner.zero_grad()
        self.local = self.optimizer is not None and self.optimizer.compressing
        if self.local:  # no backward of this step reduces, the last one included
            self._held.enter_context(self.inner.no_sync())

    def backward(self, scope: int, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.local else self.inner.backward(scope, last)

    def finish_gradient_sync(self, scale: float | torch.Tensor = 1.0) -> None:
        if not self.local:
            self.inner.finish_gradient_sync(scale)
            return
        self._held.close()
        for _, g in self._local_pieces():
            g.mul_(scale * self.comm.size)

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return self._local_pieces() if self.local else self.inner.gradient_pieces()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if not self.local:
            return self.inner.clip_grad_norm(max_norm)
        grads = [g for _, g in self._local_pieces()]
        sq = squared_norm(grads, self.comm.device) / self.comm.size
        return clip_to_global_norm(grads, sq, self.comm, max_norm)

    def after_optimizer_step(self) -> None:
        if not (self.local and self.zero is not None):  # ZeRO-1: already every rank's
            self.inner.after_optimizer_step()

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        out = dict(self.inner.model_state_bytes(optimizer))
        if isinstance(optimizer, OnebitAdam):
            out["optimizer"] = out.get("optimizer", 0) + optimizer.residual_bytes()
        return out

    def comm_stats(self) -> dict[str, float]:
        if self.local and self.optimizer is not None:
            return self.optimizer.comm_stats()
        return self.inner.comm_stats()

    def finalize(self) -> None:
        self._held.close()
        self.inner.finalize()
