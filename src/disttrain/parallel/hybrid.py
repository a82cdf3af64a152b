"""Tensor x pipeline parallelism on one model replica, and its gradient side.

:func:`apply_model_parallel` shards a model over the ``tp`` axis (by its spec's plan),
then cuts it into pipeline chunks over the ``pp`` axis (by its spec's block list), and
returns a :class:`ModelParallel`: the module this rank trains (its chunks), the loss, and
the :class:`~.placement.Placement` of its parameters in the full model. Data parallelism
(or ZeRO) is applied over ``dp`` to ``ModelParallel.module`` afterwards, unchanged, and
wrapped in :class:`ModelParallelGrads`.

Gradients: the dp strategy reduces as usual (overlapped with backward); afterwards, on
whatever gradient data each rank holds (whole gradients, or ZeRO shard pieces, which
have the same layout on every tp rank and on both holders of a tied weight), the
partial gradients of sequence parallelism are summed over tp and the tied weight's two
copies are summed over pp. Both are linear, so this equals doing them before the dp
reduction. The global norm counts every parameter's squared norm exactly once over all
ranks: a tp-replicated parameter weighs 1/tp on each tp rank, a tied copy 0, and dp
replicas are divided out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Communicator
from ..config.schema import ParallelConfig
from ..errors import TensorParallelGradientError
from ..spec import IDENTICAL, ModelSpec, block_list
from .activation import apply_activation_checkpointing, canonical_name
from .clipping import clip_to_global_norm, squared_norm
from .interfaces import GradSync, Work
from .pipeline import (
    PipelineChunk,
    Schedule,
    build_chunks,
    build_schedule,
    chunk_param_names,
    exchange_tied_grads,
    plan_stages,
)
from .pipeline.check import virtual_stages
from .pipeline.stages import StagePlan
from .placement import Placement
from .tensor import TensorParallel, apply_tensor_parallel


@dataclass
class ModelParallel:
    """This rank's part of the model under (pp, tp), and how to account for it.

    ``module``: what this rank trains (the model itself when pp = 1, else a ModuleList
    of its chunks); ``placement``: names and boxes of its parameters in the full model.
    """

    module: nn.Module
    chunks: list[PipelineChunk]
    tp: TensorParallel | None
    placement: Placement
    stages: StagePlan | None
    schedule: Schedule | None
    pp_comm: Communicator
    tp_comm: Communicator
    spec: ModelSpec

    def pipeline(self) -> tuple[StagePlan, Schedule]:
        """The stage plan and the schedule of a model cut over pp > 1."""
        if self.stages is None or self.schedule is None:
            raise ValueError("the model is not cut into pipeline stages (pp = 1)")
        return self.stages, self.schedule

    @property
    def is_last_stage(self) -> bool:
        return self.pp_comm.rank == self.pp_comm.size - 1

    @property
    def counts_loss(self) -> bool:
        """Whether this rank's loss enters the global sum: the last stage's tp rank 0
        (every tp rank of the last stage computes the same loss)."""
        return self.is_last_stage and self.tp_comm.rank == 0

    def activation_length(self, seq_len: int) -> int:
        """Positions per rank in the activations stages exchange: sequence parallelism
        keeps them split over tp between blocks."""
        if self.tp is not None and self.tp.sequence_parallel:
            return seq_len // self.tp.tp_size
        return seq_len

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(full-model name, parameter) for every parameter this rank holds."""
        seen: set[int] = set()
        for p in self.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield self.placement.name(p), p

    def fix_gradients(self, pieces: dict[int, torch.Tensor]) -> None:
        """After the dp reduction: ``pieces`` (id(parameter) -> the gradient data this
        rank holds for it) get sequence parallelism's partial sums over tp and the tied
        weight's exchange over pp."""
        if self.tp is not None:
            self.tp.sync_replicated_grads([pieces[id(p)] for p in self.tp.partial_params
                                           if id(p) in pieces])
        exchange_tied_grads([(pieces[id(w)], peer) for c in self.chunks
                             for w, peer in c.tied_weights() if id(w) in pieces],
                            self.pp_comm)

    def describe(self) -> str:
        """One line: this rank's blocks and shards."""
        parts = []
        if self.stages is not None:
            spans = [f"{self.stages.bounds[c.index]}-{self.stages.bounds[c.index + 1] - 1}"
                     for c in self.chunks]
            extra = [("embedding" if c.is_first else "") + ("head" if c.is_last else "")
                     for c in self.chunks]
            parts.append("blocks " + ", ".join(s + (f" +{e}" if e else "")
                                               for s, e in zip(spans, extra, strict=True)))
        if self.tp is not None:
            parts.append(f"1/{self.tp.tp_size} of each matrix (tp shard {self.tp.tp_rank})")
        return "; ".join(parts)


def apply_model_parallel(model: nn.Module, spec: ModelSpec, parallel: ParallelConfig,
                         pp_comm: Communicator, tp_comm: Communicator, *,
                         micro_batches: int, cuts: list[int] | None = None,
                         checkpointing: tuple[str, int] = ("none", 1)) -> ModelParallel:
    """Shard ``model`` (identically initialised on every rank) over tp, wrap its blocks
    for activation checkpointing (``(mode, k)``), cut it over pp for
    ``parallel.pp_schedule`` with ``micro_batches`` per step (``cuts``: the first block
    of each chunk after the first; None balances the spec's costs)."""
    tp = (apply_tensor_parallel(model, tp_comm, spec=spec,
                                sequence_parallel=parallel.sequence_parallel)
          if tp_comm.size > 1 else None)
    # after tp: the plan sees plain names
    apply_activation_checkpointing(model, *checkpointing, blocks=block_list(model, spec))
    chunks, stages, schedule = [], None, None
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    replicated = set() if tp is None else {id(p) for p in model.parameters()
                                           if not tp.is_sharded(p)}
    copies: set[int] = set()
    module: nn.Module = model
    if pp_comm.size > 1:
        v = virtual_stages(parallel)
        stages = plan_stages(spec, pp=pp_comm.size, v=v, cuts=cuts)
        chunks = build_chunks(model, spec, stages, pp_comm.rank)
        schedule = build_schedule(parallel.pp_schedule, pp=pp_comm.size, m=micro_batches,
                                  v=v)
        names = {}
        for chunk in chunks:
            full = chunk_param_names(chunk)
            for n, p in chunk.named_parameters():
                names[id(p)] = canonical_name(full[n])
                if n in chunk.tied_copies:
                    copies.add(id(p))
        module = nn.ModuleList(chunks)
    placement = Placement(names=names, copies=copies, tp_replicated=replicated,
                          tp_rank=tp_comm.rank, tp_size=tp_comm.size,
                          boxes_fn=(lambda n, p: tp.boxes(n)) if tp else None,
                          to_local_fn=tp.local_from_global if tp else None)
    return ModelParallel(module=module, chunks=chunks, tp=tp, placement=placement,
                         stages=stages, schedule=schedule, pp_comm=pp_comm,
                         tp_comm=tp_comm, spec=spec)


class ModelParallelGrads:
    """The dp strategy's :class:`~.interfaces.GradSync`, seen through (pp, tp): the same
    reductions, then the model-parallel fix-ups on the reduced gradients, a global norm
    over every stage and shard, and the loss totals summed over the world (only the
    ranks that count the loss contribute)."""

    def __init__(self, inner: GradSync, mp: ModelParallel, world: Communicator,
                 check_tp_grads: bool = True) -> None:
        self.inner, self.mp, self.world = inner, mp, world
        # the first step's proof that the plan's identical gradients are identical
        self.check_pending = check_tp_grads and mp.tp is not None

    @property
    def grad_replicas(self) -> int:
        return self.inner.grad_replicas  # may change with the step (1-bit Adam's phase)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.no_sync()

    def backward(self, scope: int, last: bool) -> contextlib.AbstractContextManager[None]:
        return self.inner.backward(scope, last)

    def reduce_loss_totals(self, totals: torch.Tensor) -> Work:
        if not self.mp.counts_loss:
            totals.zero_()
        return self.world.all_reduce(totals, async_op=True)

    def finish_gradient_sync(self, scale: float | torch.Tensor = 1.0) -> None:
        self.inner.finish_gradient_sync(scale)
        pieces = self.inner.gradient_pieces()
        self.mp.fix_gradients({id(p): g for p, g in pieces})
        if self.check_pending:
            self.check_pending = False
            check_identical_grads(self.mp, pieces, self.world)

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return self.inner.gradient_pieces()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every stage, tp shard and dp rank (a 0-dim tensor on
        the device); clip the pieces this rank holds if ``max_norm > 0``."""
        pieces = self.inner.gradient_pieces()
        weight = self.mp.placement.norm_weight
        sq = squared_norm([g for _, g in pieces], self.world.device,
                          [weight(p) / self.grad_replicas for p, _ in pieces])
        return clip_to_global_norm([g for _, g in pieces], sq, self.world, max_norm)

    def after_optimizer_step(self) -> None:
        self.inner.after_optimizer_step()

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self.inner.model_state_bytes(optimizer)

    def comm_stats(self) -> dict[str, float]:
        return self.inner.comm_stats()

    def finalize(self) -> None:
        self.inner.finalize()


def check_identical_grads(mp: ModelParallel, pieces: list[tuple[nn.Parameter, torch.Tensor]],
                          world: Communicator) -> None:
    """The first step's proof of the tensor-parallel classification: every parameter
    classified as replicated with identical gradients must hold the same gradient on
    every tp rank. Four checksums per parameter (sum, sum of squares, a position-weighted
    sum, sum of magnitudes) are all-gathered over tp; a parameter whose checksums differ
    by more than float noise (1e-4 of the checksum's size: the sum of magnitudes, or of
    squares; the same sums in another order differ by ~1e-7) is named in a
    :class:`~disttrain.errors.TensorParallelGradientError` raised on every rank (one
    gather over the world, so ranks of other tp groups stop too). Raised before the
    optimizer steps."""
    tp = mp.tp
    if tp is None:
        raise ValueError("check_identical_grads checks a tensor-parallel model: mp.tp is None")
    checked = [(mp.placement.name(p), g) for p, g in pieces]
    checked = [(name, g) for name, g in checked if tp.kind(name) == IDENTICAL]
    tp_comm, bad = mp.tp_comm, None
    if checked:
        sums = torch.stack([_checksums(g) for _, g in checked])  # [k, 4] float64
        every = torch.stack(tp_comm.all_gather(sums.to(tp_comm.device)))  # [tp, k, 4]
        spread = every.sub(every[0]).abs().amax(dim=0)[:, :3]  # [k, 3]
        size = every.abs().amax(dim=0)  # each checksum's own magnitude bound: [k, 4]
        scale = torch.stack([size[:, 3], size[:, 1], size[:, 3]], dim=1)
        off = (spread > 1e-4 * scale + 1e-30).any(dim=1).tolist()
        if any(off):
            name = checked[off.index(True)][0]
            bad = (f"at the first step, tensor-parallel rank(s) of group {tp_comm.name!r} "
                   f"computed different gradients for {name!r}, which the model's tp plan "
                   "classifies as replicated with identical gradients (it sees the whole "
                   "activation); it sees only each rank's heads or features: classify it "
                   "'partial' in the plan (ModelSpec.tp_plan), or set parallel.tp=1; "
                   "stopped before the optimizer step")
    found = [b for b in world.all_gather_object(bad) if b is not None]
    if found:
        raise TensorParallelGradientError(found[0])


def _checksums(g: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, position-weighted sum, sum of |g|] of ``g`` in float64."""
    x = g.detach().reshape(-1).double()
    ramp = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.float64) / x.numel()
    return torch.stack([x.sum(), x.square().sum(), (x * ramp).sum(), x.abs().sum()])

