"""A gradient sync that wraps another and changes part of what it does
(:class:`GradSyncOver`): the model-parallel view of the data-parallel strategy
(:class:`~.model_parallel.ModelParallelGrads`) and 1-bit Adam's phase-following sync
(:class:`~.onebit.grads.OnebitGrads`) override what they change; everything else goes to
the wrapped sync unchanged."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .interfaces import GradSync, Work


class GradSyncOver:
    """:class:`~.interfaces.GradSync` that hands every call to ``inner``; a subclass
    overrides the methods whose behaviour it changes."""

    def __init__(self, inner: GradSync) -> None:
        self.inner = inner

    @property
    def grad_replicas(self) -> int:
        return self.inner.grad_replicas  # may change with the step (1-bit Adam's phase)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.no_sync()

    def backward(self, scope: int, last: bool) -> contextlib.AbstractContextManager[None]:
        return self.inner.backward(scope, last)

    def reduce_loss_totals(self, totals: torch.Tensor) -> Work | None:
        return self.inner.reduce_loss_totals(totals)

    def finish_gradient_sync(self, scale: float | torch.Tensor = 1.0) -> None:
        self.inner.finish_gradient_sync(scale)

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return self.inner.gradient_pieces()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.inner.clip_grad_norm(max_norm)

    def after_optimizer_step(self) -> None:
        self.inner.after_optimizer_step()

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self.inner.model_state_bytes(optimizer)

    def comm_stats(self) -> dict[str, float]:
        return self.inner.comm_stats()

    def finalize(self) -> None:
        self.inner.finalize()
