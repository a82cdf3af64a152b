"""One optimizer step on one rank, timed: data, compute, exposed communication, optimizer.

The rank's share of the global batch (equal, or set by the dynamic splitter) is cut into
micro-batches of at most ``micro_batch`` samples; all but the last run under
``no_sync()``. The summed loss and the number of loss terms are all-reduced alongside
the last backward, and the reduced gradients are divided by the global count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm import CollectiveLedger, Communicator
from ..errors import nonfinite_part
from ..faults import maybe_slow_down
from ..monitor.saved_activations import SavedActivationMeter
from ..monitor.stats import StepStats
from ..monitor.trace import Tracer
from ..parallel.interfaces import GradSync
from .batch import Batch, LossFn, TokenLoss, loss_sum_and_terms
from .precision import LossScaler, autocast

@dataclass
class StepRunner:
    """Everything a plain step needs (no pipeline); ``run`` performs one.

    ``grads``: the composed gradient synchronisation; ``eval_comm``: the group whose
    ranks evaluate different samples (dp); ``ledger``: where collectives' wait time is
    counted."""

    model: nn.Module
    grads: GradSync
    ledger: CollectiveLedger
    eval_comm: Communicator
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn | None  # None: the batch's causal-LM loss
    load: Callable[[list[int]], Batch]
    grad_clip: float
    device: torch.device
    tracer: Tracer
    rank: int = 0
    precision: str = "fp32"
    scaler: LossScaler = field(default_factory=lambda: LossScaler(False))
    activation_bytes: int | None = None  # saved for backward, measured on the first pass
    terms_are_samples: bool = False
    grad_norm: float = 0.0
    before_update: Callable[[], Any] = lambda: None  # e.g. an async checkpoint's snapshot
    token_loss: TokenLoss | None = None  # the default loss's per-token loss (None: full)
    nonfinite: str | None = None  # what went non-finite in the last step (None: nothing)
    nonfinite_skipped: int = 0  # steps whose update was skipped for a non-finite value

    def loss(self, outputs: Any, batch: Batch) -> tuple[torch.Tensor, int, bool]:
        """(summed loss, loss terms, whether the terms are samples) of a micro-batch."""
        return loss_sum_and_terms(self.loss_fn, outputs, batch, self.token_loss)

    @classmethod
    def from_parallel(cls, parallel: Any, **common: Any) -> StepRunner:
        """The runner for a composition (:class:`~disttrain.parallel.Parallelized`):
        its module and gradient sync; held-out samples are split over dp."""
        return cls(model=parallel.module, grads=parallel.grads,
                   eval_comm=parallel.groups.dp, **common)

    def run(self, micro_batches: list[list[int]]) -> StepStats:
        stats = StepStats(samples=sum(len(m) for m in micro_batches))
        t0, waited0 = time.perf_counter(), self.ledger.wait_seconds
        self.grads.zero_grad()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        handle = None
        for i, indices in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            td = time.perf_counter()
            with self.tracer.span("data"):
                batch = self.load(indices)
            stats.data_s += time.perf_counter() - td
            with contextlib.nullcontext() if last else self.grads.no_sync():
                handle = self._forward_backward(batch, totals, last)
        if not micro_batches:  # no samples: still join every collective
            handle = self.grads.reduce_loss_totals(totals)
        maybe_slow_down(self.rank, time.perf_counter() - t0 - stats.data_s)
        if handle is not None:
            handle.wait()
        loss, count = totals.tolist()
        return self._reduce_and_step(stats, t0, waited0, loss, count)

    def _reduce_and_step(self, stats: StepStats, t0: float, waited0: float, loss: float,
                         count: float) -> StepStats:
        """Finish the gradient reduction scaled by 1 / the global loss-term count, clip,
        take the optimizer step; fill in the step's timings (from ``t0``; ``waited0``:
        the ledger's wait total then) and loss. Time blocked in collectives is
        ``comm_s``, taken out of the phase it fell in (compute or optimizer): a rank
        waiting for a slower one in the norm's all-reduce is not busy."""
        self.grads.finish_gradient_sync(1.0 / (max(count, 1.0) * self.scaler.scale))
        to, waited_mid = time.perf_counter(), self.ledger.wait_seconds
        stats.compute_s = to - t0 - stats.data_s - (waited_mid - waited0)
        with self.tracer.span("optimizer"):
            self.grad_norm = self.grads.clip_grad_norm(self.grad_clip)
            self.nonfinite = nonfinite_part(loss, self.grad_norm, self.scaler.enabled)
            self.before_update()
            if self.nonfinite is not None:  # the trainer stops, or counts the skip
                self.nonfinite_skipped += 1
                self.grads.after_skipped_step()
            elif self.scaler.update(self.grad_norm):  # fp16 overflow: skip the step
                self.optimizer.step()
                self.grads.after_optimizer_step()
            else:
                self.grads.after_skipped_step()
        stats.optim_s = time.perf_counter() - to - (self.ledger.wait_seconds - waited_mid)
        stats.total_s = time.perf_counter() - t0
        stats.comm_s = self.ledger.wait_seconds - waited0
        stats.loss, stats.terms = loss / max(count, 1.0), int(count)
        return stats

    def gradients(self, micro_batches: list[list[int]]) -> tuple[float, int, float]:
        """Forward and backward only (an async worker's half of a step; the servers
        own the optimizer): leaves this rank's gradient, normalised by its own loss-term
        count and clipped, in ``.grad``; returns (summed loss, loss terms, the
        gradient's norm before clipping)."""
        self.grads.zero_grad()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for indices in micro_batches:
            self._forward_backward(self.load(indices), totals, last=False)
        loss, count = totals.tolist()
        self.grads.finish_gradient_sync(1.0 / max(count, 1.0))
        self.grad_norm = self.grads.clip_grad_norm(self.grad_clip)
        return loss, int(count), self.grad_norm

    def eval_totals(self, batch: Batch) -> tuple[float, float]:
        """(summed loss, loss terms) of one held-out micro-batch on this rank."""
        loss_sum, count, _ = self.loss(batch.run(self.model), batch)
        return float(loss_sum), float(count)

    def reduce_eval(self, totals: torch.Tensor) -> None:
        """Sum the held-out totals over the ranks that evaluated different samples."""
        self.eval_comm.all_reduce(totals)

    def _forward_backward(self, batch: Batch, totals: torch.Tensor, last: bool) -> Any:
        saved = None
        if self.activation_bytes is None:
            saved = SavedActivationMeter(self.model.parameters())
        with saved or contextlib.nullcontext():
            with self.tracer.span("forward"), autocast(self.precision, self.device):
                loss_sum, count, samples = self.loss(batch.run(self.model),
                                                                   batch)
            loss_sum = loss_sum.float()
            self.terms_are_samples = samples
            totals[0] += loss_sum.detach().double()
            totals[1] += count
            # launched before the last backward, so it overlaps it
            handle = self.grads.reduce_loss_totals(totals) if last else None
            with self.tracer.span("backward"):
                (loss_sum * self.scaler.scale if self.scaler.enabled else loss_sum).backward()
        if saved is not None:
            self.activation_bytes = saved.peak_bytes
        return handle

