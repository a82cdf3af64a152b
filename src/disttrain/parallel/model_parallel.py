"""Every model-parallel dimension on one model replica, and its gradient side.

:func:`apply_model_parallel` applies each dimension whose entry applies something to a
model (:mod:`.dimensions`) and whose degree is > 1, in order: the ones that change the
model in place, innermost axis first (tensor parallelism shards its matrices by the
spec's plan), then activation checkpointing on the blocks, then the one that cuts the
layers into stages (the pipeline, by the spec's block list; without it the whole model
is the cut, :class:`WholeModel`). It returns a :class:`ModelParallel`: the module this
rank trains, each dimension's part, and the :class:`~.placement.Placement` of its
parameters in the full model (each part adds its own: names, boxes, copies). Data
parallelism (or ZeRO) is applied over the replica group to ``ModelParallel.module``
afterwards, unchanged, and wrapped in :class:`ModelParallelGrads`.

Gradients: the data-parallel strategy reduces as usual (overlapped with backward);
afterwards, on whatever gradient data each rank holds (whole gradients, or ZeRO shard
pieces, which have the same layout on every rank of a part's group), each part makes
its own sums (tensor parallelism's partial gradients over tp, the tied weight's two
copies over pp). They are linear, so this equals doing them before the reduction. The
global norm counts every parameter's squared norm exactly once over all ranks (the
placement's weights: 1/tp for a tp-replicated parameter, 0 for a tied copy; the
replicas divided out).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..config.schema import ParallelConfig
from ..dimensions import Role
from ..spec import ModelSpec, block_list
from .activation import apply_activation_checkpointing, canonical_name
from .applied import AppliedDimension, ApplyContext, Composed, HeadHolder, ModelCut
from .clipping import clip_to_global_norm, squared_norm
from .dimensions import in_apply_order
from .fused_loss import replace_submodule
from .grads import GradSyncOver
from .interfaces import GradSync, StepPass, StepTracer, Work
from .placement import Placement, whole_model_placement
from .step_pass import WholeModelPass
from .zero import Unit, build_units


class WholeModel(ModelCut):
    """The cut of a layout that does not cut the layers: the whole ``model`` on every
    rank, run micro-batch after micro-batch."""

    def __init__(self, model: nn.Module, spec: ModelSpec) -> None:
        self.module, self.spec = model, spec

    def step_pass(self, grads: GradSync, world: Communicator, replicas: Communicator,
                  tracer: StepTracer | None, composed: Composed) -> StepPass:
        return WholeModelPass(self.module, grads, replicas, composed.local_batch, tracer)

    def buffer_holders(self) -> list[nn.Module]:
        return [self.module]

    def head_holder(self) -> HeadHolder:
        return self.module, functools.partial(replace_submodule, self.module)

    def units(self, model: nn.Module) -> list[Unit]:
        blocks = block_list(model, self.spec)
        return build_units([(0, model, list(blocks) if blocks is not None else [])])

    def headline(self, micro_batches: int) -> str:
        return ""


@dataclass
class ModelParallel:
    """This rank's part of the model under the model-parallel dimensions, and how to
    account for it.

    ``parts``: each applied dimension's part, in the order applied (none: no dimension
    applies anything at this layout); ``cut``: the model as this rank runs it (the
    pipeline's chunks, or the whole model), whose ``module`` this rank trains;
    ``placement``: names and boxes of its parameters in the full model.
    """

    parts: list[AppliedDimension]
    cut: ModelCut
    placement: Placement
    spec: ModelSpec

    @property
    def module(self) -> nn.Module:
        return self.cut.module

    @property
    def applied(self) -> bool:
        """Whether any dimension changed the model (else it is trained whole)."""
        return bool(self.parts)

    @property
    def counts_loss(self) -> bool:
        """Whether this rank's loss enters the global sum: every part agrees (the last
        stage's tp rank 0; every tp rank of the last stage computes the same loss)."""
        return all(p.counts_loss for p in self.parts)

    def activation_length(self, seq_len: int) -> int:
        """Positions per rank in the activations between blocks."""
        for p in self.parts:
            seq_len = p.activation_length(seq_len)
        return seq_len

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a micro-batch of its replica (each part's, in turn)."""
        for p in self.parts:
            batch = p.local_batch(batch)
        return batch

    def composed(self) -> Composed:
        """What the parts together say of a micro-batch (for the cut's step pass)."""
        return Composed(activation_length=self.activation_length,
                        counts_loss=self.counts_loss, local_batch=self.local_batch)

    def token_loss(self) -> Callable[..., Any] | None:
        """The per-token loss the outputs need (None: the ordinary one)."""
        return next((f for p in self.parts if (f := p.token_loss()) is not None), None)

    def full_logits_loss(self, loss_fn: Callable[[Any, Any], Any]
                         ) -> Callable[[Any, Any], Any]:
        """``loss_fn`` called on the full logits."""
        for p in self.parts:
            loss_fn = p.full_logits_loss(loss_fn)
        return loss_fn

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(full-model name, parameter) for every parameter this rank holds."""
        seen: set[int] = set()
        for p in self.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield self.placement.name(p), p

    def fix_gradients(self, pieces: dict[int, torch.Tensor]) -> None:
        """After the replica group's reduction: ``pieces`` (id(parameter) -> the
        gradient data this rank holds for it) get each part's own sums."""
        for p in self.parts:
            p.fix_gradients(pieces)

    def check_first_step(self, pieces: list[tuple[nn.Parameter, torch.Tensor]],
                         world: Communicator) -> None:
        for p in self.parts:
            p.check_first_step(pieces, self.placement, world)

    def describe(self) -> str:
        """One line: this rank's blocks and shards (the cut's first)."""
        ordered = [self.cut, *(p for p in self.parts if p is not self.cut)]
        return "; ".join(line for p in ordered if (line := p.describe()))


def apply_model_parallel(model: nn.Module, spec: ModelSpec, parallel: ParallelConfig,
                         comms: dict[str, Communicator], *, micro_batches: int,
                         checkpointing: tuple[str, int] = ("none", 1),
                         seq_len: int | None = None) -> ModelParallel:
    """Apply to ``model`` (identically initialised on every rank) every dimension with
    something to apply and a degree > 1 (``comms``: mesh axis -> its communicator), in
    order (see the module docstring), wrapping its blocks for activation checkpointing
    (``(mode, k)``) before any cut; ``micro_batches`` per step (a pipeline's m);
    ``seq_len``: the training sequence length, where known."""
    parts: list[AppliedDimension] = []
    cut: ModelCut | None = None
    for b in in_apply_order():
        comm = comms[b.dimension.axis]
        if b.apply is None or comm.size == 1:
            continue
        cuts = b.dimension.has(Role.LAYERS)
        if cuts:  # after the in-place parts: the plan sees plain names
            apply_activation_checkpointing(model, *checkpointing,
                                           blocks=block_list(model, spec))
        part = b.apply(model, ApplyContext(spec=spec, parallel=parallel, comm=comm,
                                           micro_batches=micro_batches, seq_len=seq_len))
        parts.append(part)
        if cuts:
            if not isinstance(part, ModelCut):
                raise TypeError(f"{b.dimension.key} cuts the layers: its apply must "
                                "return a ModelCut")
            cut = part
    if cut is None:
        apply_activation_checkpointing(model, *checkpointing, blocks=block_list(model, spec))
        cut = WholeModel(model, spec)
    placement = whole_model_placement(model, canonical_name)
    for part in parts:
        placement = part.place(placement)
    return ModelParallel(parts=parts, cut=cut, placement=placement, spec=spec)


class ModelParallelGrads(GradSyncOver):
    """The data-parallel strategy's :class:`~.interfaces.GradSync`, seen through the
    model-parallel parts: the same reductions, then each part's fix-ups on the reduced
    gradients, a global norm over every stage and shard, and the loss totals summed over
    the world (only the ranks that count the loss contribute)."""

    def __init__(self, inner: GradSync, model_parallel: ModelParallel, world: Communicator) -> None:
        super().__init__(inner)
        self.model_parallel, self.world = model_parallel, world

    def reduce_loss_totals(self, totals: torch.Tensor) -> Work:
        if not self.model_parallel.counts_loss:
            totals.zero_()
        return self.world.all_reduce(totals, async_op=True)

    def finish_gradient_sync(self, scale: float | torch.Tensor = 1.0) -> None:
        self.inner.finish_gradient_sync(scale)
        pieces = self.inner.gradient_pieces()
        self.model_parallel.fix_gradients({id(p): g for p, g in pieces})
        self.model_parallel.check_first_step(pieces, self.world)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every stage, shard and replica (a 0-dim tensor on
        the device); clip the pieces this rank holds if ``max_norm > 0``."""
        pieces = self.inner.gradient_pieces()
        weight = self.model_parallel.placement.norm_weight
        sq = squared_norm([g for _, g in pieces], self.world.device,
                          [weight(p) / self.grad_replicas for p, _ in pieces])
        return clip_to_global_norm([g for _, g in pieces], sq, self.world, max_norm)
