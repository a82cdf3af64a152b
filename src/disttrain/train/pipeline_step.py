"""One optimizer step through a pipeline schedule, and evaluation through the stages.

:class:`PipelineStepRunner` runs every micro-batch of this dp rank's share through the
schedule; each chunk's backward passes run inside the gradient synchronisation's
``backward(chunk, last)`` scope, so data parallelism and every ZeRO stage reduce as
they do without a pipeline. The loss terms are counted on the last stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..monitor.stats import StepStats
from ..parallel.hybrid import ModelParallel
from ..parallel.pipeline import FORWARD, run_pipeline
from .precision import autocast
from .batch import Batch
from .step import StepRunner


@dataclass
class PipelineStepRunner(StepRunner):
    """A step through ``mp.schedule``; ``eval_comm`` is the world (the loss is counted
    on one rank of each pipeline's last stage)."""

    mp: ModelParallel | None = None

    @classmethod
    def from_parallel(cls, parallel: Any, **common: Any) -> PipelineStepRunner:
        """Every stage's held-out totals are summed over the world (one rank of each
        pipeline's last stage counts them)."""
        return cls(model=parallel.module, grads=parallel.grads, mp=parallel.mp,
                   eval_comm=parallel.groups.world, **common)

    def run(self, micro_batches: list[list[int]]) -> StepStats:
        stats = StepStats(samples=sum(len(m) for m in micro_batches))
        t0, waited0 = time.perf_counter(), self.ledger.wait_seconds
        self.grads.zero_grad()
        td = time.perf_counter()
        loaded = [self.load(indices) for indices in micro_batches]
        stats.data_s = time.perf_counter() - td
        b, t = _tokens_shape(loaded[0])
        shape = (b, self.mp.activation_length(t), self.mp.spec.hidden_size)
        with autocast(self.precision, self.device):
            result = run_pipeline(self.mp.chunks, [(m, m) for m in loaded],
                                  lambda out, batch: self.loss(out, batch)[:2],
                                  self.mp.pp_comm,
                                  self.mp.schedule, activation_shape=shape,
                                  loss_scale=self.scaler.scale if self.scaler.enabled else 1.0,
                                  grad_sync=self.grads.backward, clock=time.time)
        self._trace(result.timings)
        if self.activation_bytes is None:
            self.activation_bytes = result.peak_activation_bytes
        totals = torch.tensor([float(result.loss_sum), float(result.count)],
                              dtype=torch.float64, device=self.device)
        self.grads.reduce_loss_totals(totals).wait()
        loss, count = totals.tolist()
        return self._reduce_and_step(stats, t0, waited0, loss, count)

    def eval_totals(self, batch: Batch) -> tuple[float, float]:
        """(summed loss, terms) of one evaluation micro-batch through the pipeline,
        counted on one rank only (every tp rank of the last stage joins the
        vocab-parallel loss)."""
        out = pipeline_logits(self.mp, batch)
        if out is None:
            return 0.0, 0.0
        loss_sum, count, _ = self.loss(out, batch)
        return (float(loss_sum), float(count)) if self.mp.counts_loss else (0.0, 0.0)

    def _trace(self, timings: list) -> None:
        """Each forward / backward of the schedule, and the wait for its input message,
        as timeline spans (wall-clock seconds -> microseconds)."""
        if not self.tracer.enabled:
            return
        for t in timings:
            kind = "forward" if t.action.kind == FORWARD else "backward"
            where = {"chunk": t.action.chunk, "micro": t.action.micro}
            if t.wait > 0:
                self.tracer.complete(f"recv for {kind}", (t.start - t.wait) * 1e6,
                                     t.start * 1e6, "pipeline", **where)
            self.tracer.complete(kind, t.start * 1e6, t.end * 1e6, "pipeline", **where)


def _tokens_shape(batch: Batch) -> tuple[int, int]:
    """(micro-batch size, sequence length) of a batch's token inputs: its positional
    input, else ``input_ids``, else its first tensor."""
    if batch.args:
        first = batch.args[0]
    else:
        first = batch.kwargs.get("input_ids")
        if first is None:
            first = next(v for v in batch.kwargs.values() if isinstance(v, torch.Tensor))
    return int(first.shape[0]), int(first.shape[1])


def pipeline_logits(mp: ModelParallel, inputs: Batch | torch.Tensor
                    ) -> torch.Tensor | None:
    """Forward only, chunk after chunk (no schedule needed): the last stage gets the
    output [B, T, V(/tp)], the other stages None. ``inputs``: a micro-batch (or its
    token ids)."""
    comm, stages = mp.pp_comm, mp.stages
    mine = {c.index: c for c in mp.chunks}
    b, t = inputs.shape[:2] if isinstance(inputs, torch.Tensor) else _tokens_shape(inputs)
    t = mp.activation_length(t)
    x: torch.Tensor | None = None
    for c in range(stages.n_chunks):
        if stages.rank_of(c) != comm.rank:
            continue
        if c == 0:
            x = mine[c](None, inputs)
        else:
            x = comm.empty(b, t, mp.spec.hidden_size)
            comm.irecv(x, stages.rank_of(c - 1), tag=c).wait()
            x = mine[c](x, inputs)
        if c < stages.n_chunks - 1:
            comm.isend(x.contiguous(), stages.rank_of(c + 1), tag=c + 1).wait()
    return x if mp.is_last_stage else None
