"""The trainer's side of tensor and pipeline parallelism.

- :class:`ModelParallelGrads` wraps the dp handle (data parallelism or ZeRO) so the
  step sees model-parallel gradients: partial and tied gradients are summed before the
  dp reduction, and the norm is global over every stage and shard.
- :class:`PipelineStepRunner` runs one optimizer step through the pipeline schedule.
- :func:`pipeline_logits` is the forward-only pass used for evaluation.
- :func:`gather_full_state` assembles the unsharded model on rank 0 (final weights).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..monitor.stats import StepStats
from ..parallel.hybrid import ModelParallel, model_parallel_grad_norm
from ..parallel.pipeline import FORWARD, run_pipeline
from .precision import autocast
from .step import StepRunner, loss_sum_and_terms


class ModelParallelGrads:
    """The dp handle, seen through (pp, tp): every other attribute is the handle's.

    With a pipeline or sequence parallelism the dp reductions are deferred to
    :meth:`finish_gradient_sync` (no reduction launches from hooks during backward),
    because the tp sum of partial gradients and the tied weight's exchange must act on
    complete local gradients, before they are reduced (ZeRO keeps only a shard after).
    """

    def __init__(self, dp: Any, mp: ModelParallel, world: Communicator) -> None:
        self.dp, self.mp, self.world = dp, mp, world
        self.deferred = bool(mp.chunks) or bool(mp.tp and mp.tp.sequence_parallel)
        if self.deferred:
            dp.defer_reductions()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dp, name)

    def finish_gradient_sync(self, scale: float = 1.0) -> None:
        if self.deferred:
            self.mp.finish_backward()
        self.dp.finish_gradient_sync(scale)

    def clip_grad_norm(self, max_norm: float) -> float:
        return model_parallel_grad_norm(self.mp, self.dp, self.world, max_norm)


@dataclass
class PipelineStepRunner(StepRunner):
    """One step through the pipeline: every micro-batch of this dp rank's share goes
    through ``mp.schedule``; the loss terms are counted on the last stage."""

    mp: ModelParallel | None = None
    world: Communicator | None = None
    d_model: int = 0

    def run(self, micro_batches: list[list[int]]) -> StepStats:
        stats = StepStats(samples=sum(len(m) for m in micro_batches))
        t0, waited0 = time.perf_counter(), self.comm.ledger.wait_seconds
        self.dp.zero_grad()
        td = time.perf_counter()
        loaded = [self.load(indices) for indices in micro_batches]
        stats.data_s = time.perf_counter() - td
        b, t = loaded[0][0].shape[:2]
        t = self.mp.activation_length(t)
        with autocast(self.precision, self.device):
            result = run_pipeline(self.mp.chunks, loaded, self.loss_fn, self.mp.pp_comm,
                                  self.mp.schedule, activation_shape=(b, t, self.d_model),
                                  loss_scale=self.scaler.scale if self.scaler.enabled else 1.0,
                                  clock=time.time)
        self._trace(result.timings)
        if self.activation_bytes is None:
            self.activation_bytes = result.peak_activation_bytes
        counts = self.mp.counts_loss
        totals = torch.tensor([float(result.loss_sum) if counts else 0.0,
                               float(result.count) if counts else 0.0], dtype=torch.float64)
        self.world.all_reduce(totals)
        loss, count = totals.tolist()
        return self._reduce_and_step(stats, t0, waited0, loss, count)


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


def pipeline_logits(mp: ModelParallel, inputs: torch.Tensor, d_model: int
                    ) -> torch.Tensor | None:
    """Forward only, chunk after chunk (no schedule needed): the last stage gets the
    output [B, T, V(/tp)], the other stages None."""
    comm, stages = mp.pp_comm, mp.stages
    mine = {c.index: c for c in mp.chunks}
    b, t = inputs.shape[0], mp.activation_length(inputs.shape[1])
    x: torch.Tensor | None = None
    for c in range(stages.n_chunks):
        if stages.rank_of(c) != comm.rank:
            continue
        if c == 0:
            x = mine[c](inputs)
        else:
            x = torch.empty(b, t, d_model, device=inputs.device)
            comm.irecv(x, stages.rank_of(c - 1), tag=c).wait()
            x = mine[c](x)
        if c < stages.n_chunks - 1:
            comm.isend(x.contiguous(), stages.rank_of(c + 1), tag=c + 1).wait()
    return x if mp.is_last_stage else None


def pipeline_eval_totals(mp: ModelParallel, loss_fn: Any, inputs: torch.Tensor,
                         targets: torch.Tensor, d_model: int) -> tuple[float, float]:
    """(summed loss, terms) of one evaluation micro-batch through the pipeline, counted
    on one rank only (every tp rank of the last stage joins the vocab-parallel loss)."""
    out = pipeline_logits(mp, inputs, d_model)
    if out is None:
        return 0.0, 0.0
    loss_sum, count, _ = loss_sum_and_terms(loss_fn, out, targets)
    return (float(loss_sum), float(count)) if mp.counts_loss else (0.0, 0.0)


def gather_full_state(mp: ModelParallel, world: Communicator, dp_rank: int
                      ) -> dict[str, torch.Tensor] | None:
    """The unsharded model's parameters on global rank 0 (None elsewhere): every rank
    sends the boxes it writes in checkpoints (one all-gather of small objects; meant
    for final weights, not for models too large for one host)."""
    pieces = [(name, [(b.global_offsets, b.shape, b.global_shape) for b in
                      mp.boxes(name, p)], _local_boxes(mp, name, p))
              for name, p in mp.named_parameters() if mp.writes(p, dp_rank)]
    everyone = world.all_gather_object(pieces)
    if world.rank != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for rank_pieces in everyone:
        for name, boxes, tensors in rank_pieces:
            for (offsets, shape, global_shape), t in zip(boxes, tensors):
                out = full.setdefault(name, torch.empty(global_shape, dtype=t.dtype))
                out[tuple(slice(o, o + n) for o, n in zip(offsets, shape))] = t
    return full


def _local_boxes(mp: ModelParallel, name: str, p: nn.Parameter) -> list[torch.Tensor]:
    return [p.detach()[b.local_slices()].cpu().clone() for b in mp.boxes(name, p)]
