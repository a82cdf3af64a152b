"""A step's micro-batches through a pipeline schedule: the :class:`~..interfaces.StepPass`
of a layout with pipeline chunks.

Every micro-batch of this replica's share goes through the cut's schedule; each chunk's
backward passes run inside the gradient synchronisation's ``backward(chunk, last)``
scope, so data parallelism and every ZeRO stage reduce as they do without a pipeline.
The loss terms are counted on the last stage; held-out totals are summed over the
world (one rank of each pipeline's last stage counts them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ...comm.collectives import Communicator
from ..applied import Composed
from ..interfaces import GradSync, LossOf, NoTrace, StepTracer, Work
from .chunks import PipelineChunk
from .cuts import StagePlan
from .runner import ActionTiming, run_pipeline
from .schedules import FORWARD, WEIGHT, Schedule


@dataclass(frozen=True)
class ChunksRun:
    """What a pass needs of a cut: this rank's ``chunks``, the ``stages`` and
    ``schedule`` they follow over ``comm`` (the pp group), the activations' width
    ``hidden``, and what the ``composed`` parts say of a micro-batch (positions per
    rank between blocks, whether this rank's loss counts, this rank's part of it)."""

    chunks: list[PipelineChunk]
    stages: StagePlan
    schedule: Schedule
    comm: Communicator
    hidden: int
    composed: Composed

    @property
    def counts_loss(self) -> bool:
        return self.composed.counts_loss

    def activation_shape(self, batch: Any) -> tuple[int, int, int]:
        """[B, T', hidden] of the activations between chunks for a micro-batch of its
        replica (T' the positions this rank holds of its T)."""
        b, t = tokens_shape(batch)
        return b, self.composed.activation_length(t), self.hidden

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last chunk (pp rank pp - 1, or 0 in a V)."""
        return any(c.is_last for c in self.chunks)


class PipelinePass:
    """This rank's chunks run by their schedule."""

    def __init__(self, run: ChunksRun, grads: GradSync, world: Communicator,
                 tracer: StepTracer | None = None) -> None:
        self.run, self.grads, self.eval_comm = run, grads, world
        self.tracer = tracer or NoTrace()

    def forward_backward(self, batches: Sequence[Callable[[], Any]], loss: LossOf,
                         totals: torch.Tensor, loss_scale: torch.Tensor | None,
                         autocast: Callable[[], AbstractContextManager[None]],
                         measure: bool) -> tuple[Work | None, int | None]:
        run = self.run
        whole = [load() for load in batches]
        shape = run.activation_shape(whole[0])
        loaded = [run.composed.local_batch(m) for m in whole]
        with autocast():
            result = run_pipeline(run.chunks, [(m, m) for m in loaded], loss,
                                  run.comm, run.schedule, activation_shape=shape,
                                  loss_scale=loss_scale, grad_sync=self.grads.backward,
                                  clock=time.time, measure_activations=measure)
        self._trace(result.timings)
        totals[0] += result.loss_sum  # device tensors: nothing read on the host
        totals[1] += result.count
        totals[2] += sum(m.positions() for m in loaded)  # host ints
        return self.grads.reduce_loss_totals(totals), result.peak_activation_bytes

    def eval_loss(self, batch: Any, loss: LossOf) -> tuple[float, float]:
        """Counted on one rank only (every tp rank of the last stage joins the
        vocabulary-parallel loss)."""
        run = self.run
        shape = run.activation_shape(batch)
        local = run.composed.local_batch(batch)
        out = pipeline_logits(run, local, shape)
        if out is None:
            return 0.0, 0.0
        loss_sum, count = loss(out, local)
        return (float(loss_sum), float(count)) if self.run.counts_loss else (0.0, 0.0)

    def _trace(self, timings: list[ActionTiming]) -> None:
        """Each forward / backward / weight pass of the schedule, and the wait for its
        input message, as timeline spans (wall-clock seconds -> microseconds)."""
        if not self.tracer.enabled:
            return
        for t in timings:
            kind = {FORWARD: "forward", WEIGHT: "weight"}.get(t.action.kind, "backward")
            where = {"chunk": t.action.chunk, "micro": t.action.micro}
            if t.wait > 0:
                self.tracer.complete(f"recv for {kind}", (t.start - t.wait) * 1e6,
                                     t.start * 1e6, "pipeline", **where)
            self.tracer.complete(kind, t.start * 1e6, t.end * 1e6, "pipeline", **where)


def tokens_shape(batch: Any) -> tuple[int, int]:
    """(micro-batch size, sequence length) of a batch's token inputs: its positional
    input, else ``input_ids``, else its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]), int(batch.shape[1])
    if batch.args:
        first = batch.args[0]
    else:
        first = batch.kwargs.get("input_ids")
        if first is None:
            first = next(v for v in batch.kwargs.values() if isinstance(v, torch.Tensor))
    return int(first.shape[0]), int(first.shape[1])


def pipeline_logits(run: ChunksRun, inputs: Any, shape: tuple[int, int, int]
                    ) -> torch.Tensor | None:
    """Forward only, chunk after chunk (no schedule needed): the last stage gets the
    output [B, T', V(/tp)], the other stages None. ``inputs``: this rank's part of a
    micro-batch; ``shape``: the activations' between chunks
    (:meth:`ChunksRun.activation_shape`)."""
    comm, stages = run.comm, run.stages
    mine = {c.index: c for c in run.chunks}
    x: torch.Tensor | None = None
    for c in range(stages.n_chunks):
        if stages.rank_of(c) != comm.rank:
            continue
        if c == 0:
            x = mine[c](None, inputs)
        elif stages.rank_of(c - 1) == comm.rank:  # the turn of a V: x is already here
            x = mine[c](x, inputs)
        else:
            x = comm.empty(*shape)
            comm.irecv(x, stages.rank_of(c - 1), tag=c).wait()
            x = mine[c](x, inputs)
        if c < stages.n_chunks - 1 and stages.rank_of(c + 1) != comm.rank:
            comm.isend(x.contiguous(), stages.rank_of(c + 1), tag=c + 1).wait()
    return x if run.is_last_stage else None
