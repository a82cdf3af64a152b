"""What a parallel dimension does to a model replica, declared as protocols.

A dimension whose entry applies something to the model (:mod:`.dimensions`) is handed
the model, its spec, the config and its axis's communicator (:class:`ApplyContext`) and
returns an :class:`AppliedDimension`: its part of the composed model, which the
composition (:mod:`.model_parallel`) folds with the others' without knowing which it holds.
The dimension that cuts the model's layers into stages returns a :class:`ModelCut`,
which also decides how a step's micro-batches run; without one the whole model is the
cut (:class:`~.model_parallel.WholeModel`).

Every method of :class:`AppliedDimension` has the answer of a part that changes
nothing (a dimension overrides what it changes): it counts the loss, leaves
gradients, activations, micro-batches and the loss alone, and adds nothing to the
placement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..comm.collectives import Communicator
from ..config.schema import ParallelConfig
from ..spec import ModelSpec
from .interfaces import GradSync, SequenceBatch, StepPass, StepTracer
from .placement import Placement
from .zero import Unit

# where a rank runs the output head, with how to replace a module there (None: another
# rank runs it)
HeadHolder = tuple[nn.Module, Callable[[str, nn.Module], nn.Module]] | None


@dataclass(frozen=True, kw_only=True)
class ApplyContext:
    """What a dimension applies itself from: the model's ``spec``, the ``[parallel]``
    section, its axis's communicator ``comm`` (degree > 1), the micro-batches per step
    and replica (a pipeline's m), the training sequence length (``model.seq_len``;
    None where unknown)."""

    spec: ModelSpec
    parallel: ParallelConfig
    comm: Communicator
    micro_batches: int
    seq_len: int | None = None


class AppliedDimension(Protocol):
    """One dimension's part of this rank's composed model (defaults: a part that
    changes nothing)."""

    def describe(self) -> str:
        """This rank's part, in a few words for the start-up banner ('' for nothing)."""
        return ""

    @property
    def counts_loss(self) -> bool:
        """Whether this rank's loss enters the global sum, among this dimension's ranks
        (False where another rank of the group computes the same loss)."""
        return True

    def place(self, placement: Placement) -> Placement:
        """``placement`` with this part's contribution (names, boxes, copies)."""
        return placement

    def fix_gradients(self, pieces: dict[int, torch.Tensor]) -> None:
        """After the replica group's reduction, on ``pieces`` (id(parameter) -> the
        gradient data this rank holds): this dimension's own sums (linear, so equal to
        doing them before the reduction)."""
        return None

    def check_first_step(self, pieces: list[tuple[nn.Parameter, torch.Tensor]],
                         placement: Placement, world: Communicator) -> None:
        """After the first step's reductions, before its optimizer step: whatever this
        part proves about the gradients (a collective over ``world``: every rank calls
        it)."""
        return None

    def activation_length(self, seq_len: int) -> int:
        """Positions per rank of the activations between blocks, for ``seq_len``."""
        return seq_len

    def local_batch(self, batch: SequenceBatch) -> SequenceBatch:
        """This rank's part of a micro-batch of its replica (the whole one: the
        identity), which the step passes run."""
        return batch

    def token_loss(self) -> Callable[..., Any] | None:
        """The per-token loss the model's outputs need here (None: the ordinary one)."""
        return None

    def full_logits_loss(self, loss_fn: Callable[[Any, Any], Any]
                         ) -> Callable[[Any, Any], Any]:
        """``loss_fn`` as it must be called on this part's outputs to see the full
        logits."""
        return loss_fn


@dataclass(frozen=True)
class Composed:
    """What the composed parts say of a micro-batch, which a cut's step pass needs:
    ``activation_length`` (positions per rank between blocks, of a sequence's),
    ``counts_loss`` (this rank's loss enters the global sum) and ``local_batch``
    (this rank's part of a micro-batch)."""

    activation_length: Callable[[int], int]
    counts_loss: bool
    local_batch: Callable[[Any], Any]


@runtime_checkable
class ModelCut(AppliedDimension, Protocol):
    """The model as this rank runs it: its pipeline chunks, or the whole model."""

    module: nn.Module

    def step_pass(self, grads: GradSync, world: Communicator, replicas: Communicator,
                  tracer: StepTracer | None, composed: Composed) -> StepPass:
        """How a step's micro-batches run forward and backward on this cut; held-out
        totals are summed over ``replicas`` (the replica group: its ranks evaluate
        different data with the same parameters) or the world; ``composed``: what the
        composition of every part says of a micro-batch."""
        ...

    def buffer_holders(self) -> list[nn.Module]:
        """The modules whose buffers keep the full model's names."""
        ...

    def head_holder(self) -> HeadHolder:
        """Where this rank runs the output head (None: another rank)."""
        ...

    def units(self, model: nn.Module) -> list[Unit]:
        """This rank's parameters grouped for sharding (per block, per backward scope)."""
        ...

    def headline(self, micro_batches: int) -> str:
        """What the banner's layout line adds for this cut ('' for nothing)."""
        ...
