"""A step's micro-batches through the whole module (no pipeline): the
:class:`~.interfaces.StepPass` of every layout without pipeline chunks.

All but the last micro-batch run under the gradient sync's ``no_sync()``; the reduction
of the step's loss totals starts just before the last backward, so it overlaps it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..monitor.saved_activations import SavedActivationMeter
from .interfaces import GradSync, LossOf, NoTrace, StepTracer, Work


class WholeModelPass:
    """Forward and backward of ``module`` per micro-batch (``local_batch``: this rank's
    part of each); held-out totals are summed over ``eval_comm`` (the replica group:
    its ranks evaluate different samples, or different tokens of them)."""

    def __init__(self, module: nn.Module, grads: GradSync, eval_comm: Communicator,
                 local_batch: Callable[[Any], Any] | None = None,
                 tracer: StepTracer | None = None) -> None:
        self.module, self.grads, self.eval_comm = module, grads, eval_comm
        self.local_batch = local_batch or _whole
        self.tracer = tracer or NoTrace()

    def forward_backward(self, batches: Sequence[Callable[[], Any]], loss: LossOf,
                         totals: torch.Tensor, loss_scale: torch.Tensor | None,
                         autocast: Callable[[], AbstractContextManager[None]],
                         measure: bool) -> tuple[Work | None, int | None]:
        handle, peak = None, None
        for i, load in enumerate(batches):
            last = i == len(batches) - 1
            batch = self.local_batch(load())
            meter = SavedActivationMeter(self.module.parameters()) if measure else None
            with contextlib.nullcontext() if last else self.grads.no_sync():
                with meter or contextlib.nullcontext():
                    handle = self._one(batch, loss, totals, loss_scale, autocast, last)
            if meter is not None:
                peak, measure = meter.peak_bytes, False
        if not batches:  # no samples: still join every collective
            handle = self.grads.reduce_loss_totals(totals)
        return handle, peak

    def _one(self, batch: Any, loss: LossOf, totals: torch.Tensor,
             loss_scale: torch.Tensor | None,
             autocast: Callable[[], AbstractContextManager[None]], last: bool
             ) -> Work | None:
        with self.tracer.span("forward"), autocast():
            loss_sum, count = loss(batch.run(self.module), batch)
        loss_sum = loss_sum.float()
        totals[0] += loss_sum.detach().double()
        totals[1] += count
        totals[2] += batch.positions()  # a host int: nothing read from the device
        # launched before the last backward, so it overlaps it
        handle = self.grads.reduce_loss_totals(totals) if last else None
        with self.tracer.span("backward"):
            (loss_sum if loss_scale is None else loss_sum * loss_scale).backward()
        return handle

    def eval_loss(self, batch: Any, loss: LossOf) -> tuple[float, float]:
        batch = self.local_batch(batch)
        loss_sum, count = loss(batch.run(self.module), batch)
        return float(loss_sum), float(count)


def _whole(batch: Any) -> Any:
    return batch
