"""Pipeline parallelism as a dimension of the layout (entry ``pp`` of
:data:`disttrain.dimensions.DIMENSIONS`): the cut of a model replica into stages.

:func:`apply_pipeline_dimension` cuts the model (by its spec's block list, after the
parts applied in place and activation checkpointing) into ``pp x v`` chunks, keeps this
rank's, and builds the schedule ``parallel.pp_schedule`` names; the
:class:`PipelineCut` it returns is the composition's :class:`~..applied.ModelCut`: the
module this rank trains (a ModuleList of its chunks, each keeping the full model's
parameter names), the step run by the schedule (:class:`.passes.PipelinePass`), the tied
weight's copies (never saved, exchanged over pp after the reduction), and the loss counted
on the last stage.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...comm import Communicator
from ...dimensions import dimension
from ...spec import ModelSpec
from ..activation import canonical_name
from ..applied import ApplyContext, Composed, HeadHolder, ModelCut
from ..interfaces import GradSync, StepPass, StepTracer
from ..placement import Placement
from ..zero import Unit, build_units
from .build import build_chunks, chunk_param_names
from .check import pipeline_cuts, virtual_stages
from .chunks import PipelineChunk
from .cuts import StagePlan, plan_stages
from .passes import ChunksRun, PipelinePass
from .schedules import V_SCHEDULES, Schedule, build_schedule
from .tied import exchange_tied_grads

ENTRY = dimension("pp")


class PipelineCut(ModelCut):
    """This rank's chunks of the model (``chunks``, in ``module``) on the ``stages`` and
    ``schedule`` over ``comm`` (the pp group); ``schedule_name``: as configured."""

    def __init__(self, chunks: list[PipelineChunk], stages: StagePlan, schedule: Schedule,
                 comm: Communicator, spec: ModelSpec, schedule_name: str) -> None:
        self.chunks, self.stages, self.schedule = chunks, stages, schedule
        self.comm, self.spec, self.schedule_name = comm, spec, schedule_name
        self.module: nn.Module = nn.ModuleList(chunks)

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last chunk (pp rank pp - 1, or 0 in a V)."""
        return any(c.is_last for c in self.chunks)

    @property
    def counts_loss(self) -> bool:
        """The last stage computes the loss."""
        return self.is_last_stage

    def describe(self) -> str:
        spans = [f"{self.stages.bounds[c.index]}-{self.stages.bounds[c.index + 1] - 1}"
                 for c in self.chunks]
        extra = [("embedding" if c.is_first else "") + ("head" if c.is_last else "")
                 for c in self.chunks]
        return "blocks " + ", ".join(s + (f" +{e}" if e else "")
                                     for s, e in zip(spans, extra, strict=True))

    def place(self, placement: Placement) -> Placement:
        """The chunks' parameters by their full-model names; a tied weight's copy on the
        last stage is a copy (saved by the first)."""
        names: dict[int, str] = {}
        copies: set[int] = set()
        for chunk in self.chunks:
            full = chunk_param_names(chunk)
            for n, p in chunk.named_parameters():
                names[id(p)] = canonical_name(full[n])
                if n in chunk.tied_copies:
                    copies.add(id(p))
        return dataclasses.replace(placement, names=names, copies=placement.copies | copies)

    def fix_gradients(self, pieces: dict[int, torch.Tensor]) -> None:
        """The tied weight's two copies summed over pp."""
        exchange_tied_grads([(pieces[id(w)], peer) for c in self.chunks
                             for w, peer in c.tied_weights() if id(w) in pieces], self.comm)

    def step_pass(self, grads: GradSync, world: Communicator, replicas: Communicator,
                  tracer: StepTracer | None, composed: Composed) -> StepPass:
        """Held-out totals are summed over the world (the ranks of each pipeline's last
        stage that count the loss count them)."""
        run = ChunksRun(self.chunks, self.stages, self.schedule, self.comm,
                        self.spec.hidden_size, composed)
        return PipelinePass(run, grads, world, tracer)

    def buffer_holders(self) -> list[nn.Module]:
        return list(self.chunks)

    def head_holder(self) -> HeadHolder:
        """The last chunk, where this rank holds it."""
        return next(((c, c.replace_module) for c in self.chunks if c.is_last), None)

    def units(self, model: nn.Module) -> list[Unit]:
        """Per chunk (a backward scope each), its blocks then the rest; a tied weight
        whose copies live on two stages gets a unit of its own, so both copies are
        sharded alike."""
        scopes = [(c.index, c, c.chunk_blocks()) for c in self.chunks]
        tied = {id(w) for c in self.chunks for w, _ in c.tied_weights()}
        return build_units(scopes, separate=tied)

    def headline(self, micro_batches: int) -> str:
        return f", schedule {self.schedule_name} with {micro_batches} micro-batches"


def apply_pipeline_dimension(model: nn.Module, ctx: ApplyContext) -> PipelineCut:
    """Cut ``model`` over ``ctx.comm`` for ``parallel.pp_schedule`` with
    ``ctx.micro_batches`` per step (``parallel.pp_split``'s cuts, or balanced by the
    spec's costs)."""
    par, comm, spec = ctx.parallel, ctx.comm, ctx.spec
    v = virtual_stages(par)
    stages = plan_stages(spec, pp=comm.size, v=v, cuts=pipeline_cuts(par, spec),
                         vshape=par.pp_schedule in V_SCHEDULES)
    chunks = build_chunks(model, spec, stages, comm.rank)
    schedule = build_schedule(par.pp_schedule, pp=comm.size, m=ctx.micro_batches, v=v)
    return PipelineCut(chunks, stages, schedule, comm, spec, par.pp_schedule)
