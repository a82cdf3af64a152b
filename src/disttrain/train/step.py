"""One optimizer step on one rank, timed: data, compute, exposed communication, optimizer.

The rank's share of the global batch (equal, or set by the dynamic splitter) is cut into
micro-batches of at most ``micro_batch`` samples; the composition's
:class:`~disttrain.parallel.interfaces.StepPass` runs them forward and backward (through
the module, or through the pipeline schedule). The summed loss and the number of loss
terms are all-reduced alongside the last backward, and the reduced gradients are
divided by the global count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..comm import CollectiveLedger
from ..errors import nonfinite_part
from ..faults import maybe_slow_down
from ..monitor.stats import StepStats
from ..parallel.interfaces import GradSync, StepPass, StepTracer
from .batch import Batch, LossFn, TokenLoss, loss_sum_and_terms
from .precision import LossScaler, autocast


@dataclass
class StepRunner:
    """Everything a step needs; ``run`` performs one.

    ``passes``: how the micro-batches go forward and backward; ``grads``: the composed
    gradient synchronisation; ``ledger``: where collectives' wait time is counted."""

    passes: StepPass
    grads: GradSync
    ledger: CollectiveLedger
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn | None  # None: the batch's causal-LM loss
    load: Callable[[list[int]], Batch]
    grad_clip: float
    device: torch.device
    tracer: StepTracer
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

    def loss(self, outputs: Any, batch: Batch) -> tuple[torch.Tensor, int]:
        """(summed loss, loss terms) of a micro-batch (and whether the terms are
        samples, kept for the progress line's unit)."""
        loss_sum, count, samples = loss_sum_and_terms(self.loss_fn, outputs, batch,
                                                      self.token_loss)
        self.terms_are_samples = samples
        # a count may stay a tensor (see loss_sum_and_terms): the passes only add it
        # to ``totals``; LossOf (parallel.interfaces) declares it int
        return loss_sum, cast(int, count)

    def run(self, micro_batches: list[list[int]]) -> StepStats:
        stats = StepStats(samples=sum(len(m) for m in micro_batches))
        t0, waited0 = time.perf_counter(), self.ledger.wait_seconds
        self.grads.zero_grad()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        handle = self._forward_backward(micro_batches, totals, stats)
        maybe_slow_down(self.rank, time.perf_counter() - t0 - stats.data_s)
        if handle is not None:
            handle.wait()
        loss, count = totals.tolist()
        return self._reduce_and_step(stats, t0, waited0, loss, count)

    def _forward_backward(self, micro_batches: list[list[int]], totals: torch.Tensor,
                          stats: StepStats | None) -> Any:
        """The pass over ``micro_batches``, each loaded when the pass asks for it (the
        time counted as ``stats.data_s``)."""
        def loader(indices: list[int]) -> Callable[[], Batch]:
            def load() -> Batch:
                td = time.perf_counter()
                with self.tracer.span("data"):
                    batch = self.load(indices)
                if stats is not None:
                    stats.data_s += time.perf_counter() - td
                return batch
            return load
        handle, measured = self.passes.forward_backward(
            [loader(m) for m in micro_batches], self.loss, totals,
            self.scaler.scale if self.scaler.enabled else 1.0,
            lambda: autocast(self.precision, self.device),
            measure=self.activation_bytes is None)
        if measured is not None and self.activation_bytes is None:
            self.activation_bytes = measured
        return handle

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
        """Forward and backward only (a worker's half of a step whose update is made
        elsewhere): leaves this rank's gradient, normalised by its own loss-term count
        and clipped, in ``.grad``; returns (summed loss, loss terms, the gradient's norm
        before clipping)."""
        self.grads.zero_grad()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        handle = self._forward_backward(micro_batches, totals, None)
        if handle is not None:
            handle.wait()
        loss, count = totals.tolist()
        self.grads.finish_gradient_sync(1.0 / max(count, 1.0))
        self.grad_norm = self.grads.clip_grad_norm(self.grad_clip)
        return loss, int(count), self.grad_norm

    def eval_totals(self, batch: Batch) -> tuple[float, float]:
        """(summed loss, loss terms) of one held-out micro-batch on this rank."""
        return self.passes.eval_loss(batch, self.loss)

    def reduce_eval(self, totals: torch.Tensor) -> None:
        """Sum the held-out totals over the ranks that evaluated different samples."""
        self.passes.eval_comm.all_reduce(totals)
