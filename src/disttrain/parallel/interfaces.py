"""The roles a strategy plays for the training loop, declared as protocols.

A composed strategy (:func:`disttrain.parallel.compose`) hands the loop two objects:

- :class:`GradSync`: how this rank's gradients become the global step's gradients
  (reductions overlapped with backward, accumulation, the loss normalisation, the global
  norm, what follows the optimizer step);
- :class:`ShardedState`: which training state this rank owns (the optimizer's
  parameters, the pieces it saves under global names and boxes) and how it loads any
  checkpoint.

The loop calls nothing else on them, and nothing branches on which strategy it holds;
a new strategy implements these and registers itself (:mod:`.registry`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .placement import StatePiece


class Work(Protocol):
    """An asynchronous collective in flight."""

    def wait(self) -> object: ...


@runtime_checkable
class GradSync(Protocol):
    """Gradient synchronisation of one rank for one optimizer step at a time.

    ``grad_replicas``: how many ranks hold each of this rank's gradient pieces after
    :meth:`finish_gradient_sync` (the dp size when gradients are all-reduced, 1 when
    they are sharded), so a global norm counts every element once.
    """

    @property
    def grad_replicas(self) -> int: ...

    def zero_grad(self) -> None:
        """Start a step: gradients zero."""

    def no_sync(self) -> AbstractContextManager[None]:
        """A backward pass whose gradients are only accumulated (not the step's last)."""

    def backward(self, scope: int, last: bool) -> AbstractContextManager[None]:
        """One backward pass of pipeline chunk ``scope`` (0 without a pipeline);
        ``last``: the chunk's last backward of the step."""

    def reduce_loss_totals(self, totals: torch.Tensor) -> Work | None:
        """Start summing ``totals`` ([summed loss, loss terms, positions], float64) over the ranks
        whose gradients are summed with this one's; None if none are."""

    def finish_gradient_sync(self, scale: float | torch.Tensor) -> None:
        """Complete the reductions; gradients become ``scale`` x their global sum
        (``scale``: a number, or a 0-dim tensor on the device, never read on the host)."""

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, the gradient data this rank holds for it) after the sync."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm, a 0-dim tensor on the device (not read on the
        host); gradients clipped to ``max_norm`` if it is > 0."""

    def after_optimizer_step(self) -> None:
        """Whatever the optimizer's update must be followed by (e.g. all-gathers). The
        update may have been skipped on the device (a nan / inf in the step's loss or
        gradients): what follows must be right either way, and whatever the skipped
        gradients reached (a codec's error-feedback state) loses their nan / inf."""

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""

    def comm_stats(self) -> dict[str, float]:
        """Figures of the last gradient sync for the metrics (may be empty)."""

    def finalize(self) -> None:
        """End of training: the model is left plain, with its full parameters."""


class TensorSource(Protocol):
    """Global tensors by name (a checkpoint's reader)."""

    def names(self, prefix: str = "") -> list[str]:
        """The names of the tensors this source holds, those starting with ``prefix``."""

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The global shape of tensor ``name``, without reading it."""


@runtime_checkable
class PartialSource(Protocol):
    """A :class:`TensorSource` that can read parts of its tensors only: told the boxes
    (global offsets, sizes) this rank holds of each ``model/<name>``, its ``tensor``
    returns tensors of the whole shape in which only those boxes hold values."""

    def want(self, boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
             ) -> None: ...


@runtime_checkable
class ShardedState(Protocol):
    """The training state this rank owns. Parameters with ``requires_grad=False`` do not
    train: they are in no optimizer group and need not be saved (the run's initial
    source gives them back on a resume)."""

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """The optimizer's parameter groups (matrices decayed, the rest not; trainable
        parameters only)."""

    def state_pieces(self, optimizer: torch.optim.Optimizer) -> list[StatePiece]:
        """The pieces this rank saves; over all ranks they cover the state once."""

    def frozen_pieces(self) -> list[StatePiece]:
        """The pieces of the frozen parameters that :meth:`state_pieces` leaves out;
        over all ranks they cover each such parameter once (the final weights hold
        them)."""

    def load_state(self, source: TensorSource, optimizer: torch.optim.Optimizer) -> None:
        """Load this rank's part of the state (and the optimizer's) from global tensors
        saved in any layout; a frozen parameter only where ``source`` holds it."""


class SyncStrategy(Protocol):
    """How data-parallel replicas stay in step between optimizer steps (``train.sync``).

    The loop calls it at fixed points: :meth:`select` before a step, :meth:`after_step`
    after it, :meth:`at_boundary` before a checkpoint, :meth:`restart` after the
    parameters were replaced (a resume, a fill from pretrained weights).
    ``steps_apart``: replicas step on their own gradients between rounds, so a nan on
    one rank is in no total the others see within the step (the loop agrees on it).
    """

    steps_apart: bool

    def select(self, step: int, indices: list[int]) -> list[int] | None:
        """This rank's dataset indices for 0-based ``step`` (``indices``: its share of
        the global batch); None when this rank sits the step out."""

    def after_step(self, done: int, last: bool) -> None:
        """After optimizer step ``done`` (1-based); ``last`` on the final one."""

    def at_boundary(self, done: int) -> bool:
        """Whether every replica holds the same parameters after step ``done``."""

    def restart(self) -> None:
        """The parameters were replaced: state kept from the old ones starts over."""

    def metrics(self) -> dict[str, Any]:
        """Fields for the metrics records and the summary (may be empty)."""


class WorkerGradients(Protocol):
    """One worker's forward and backward over its micro-batches, without the update:
    (summed loss, loss terms, the gradient's norm before clipping, the positions the
    loss ran over), the gradient normalised by its own terms and clipped, in
    ``.grad``."""

    def __call__(self, micro_batches: list[list[int]]
                 ) -> tuple[float, int, float, int]: ...


@dataclass(frozen=True, kw_only=True)
class OwnLoopInputs:
    """What a sync mode that runs its own loop is handed: the run's optimizer, its
    length, the sample order, each worker's share of a global batch and its
    micro-batch, the worker's gradient computation, the LR schedule and a logger."""

    optimizer: torch.optim.Optimizer
    steps: int
    sampler: Any  # GlobalOrderSampler: .indices(start, count)
    per_worker: int
    micro_batch: int
    compute: WorkerGradients
    lr_at: Callable[[int], float]
    log: Callable[[Any], None]  # a MetricsRecord
    log_every: int


@dataclass(frozen=True, kw_only=True)
class OwnLoopResult:
    """What such a loop reports: the samples consumed, loss terms and positions (see
    :class:`~disttrain.monitor.stats.StepStats`), seconds in the loop,
    the mean training loss, the pushes skipped as non-finite, and (step, what) if it
    stopped on a non-finite value."""

    samples: int
    terms: int
    positions: int
    loop_s: float
    train_loss: float
    nonfinite_skipped: int
    diverged: tuple[int, str] | None


@runtime_checkable
class RunsOwnLoop(Protocol):
    """A sync mode that replaces the step loop with its own (parameter servers and
    workers): the loop hands it :class:`OwnLoopInputs` and writes no checkpoints."""

    def run_loop(self, inputs: OwnLoopInputs) -> OwnLoopResult: ...


@runtime_checkable
class RankLocalState(Protocol):
    """An optimizer whose state differs between dp ranks (1-bit Adam's error-feedback
    residuals): ``rank_keys`` name per-rank tensors of a parameter's shape (saved as row
    ``dp_rank`` of a global [dp, *shape] tensor), ``range_keys`` [start, stop) ranges of
    the flattened parameter that the dp ranks' ranges tile. The sharded states save and
    load them through these methods."""

    rank_keys: tuple[str, ...]
    range_keys: tuple[str, ...]

    def rank_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def range_state(self, p: torch.Tensor) -> dict[str, tuple[int, int, torch.Tensor]]: ...

    def load_rank_state(self, p: torch.Tensor, key: str, value: torch.Tensor) -> None: ...

    def load_range_state(self, p: torch.Tensor, key: str, full: torch.Tensor) -> None: ...


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which a gradient sync keeps in place for every parameter it holds
    (refused, naming the parameter's shape, if it is missing)."""
    if p.grad is None:
        raise RuntimeError(f"parameter of shape {tuple(p.shape)} has no gradient where "
                           "the gradient sync keeps one")
    return p.grad


def rank_local_state(optimizer: torch.optim.Optimizer) -> RankLocalState | None:
    """``optimizer``'s per-rank state, or None for an optimizer whose state is the same
    on every replica."""
    return optimizer if isinstance(optimizer, RankLocalState) else None


class SequenceBatch(Protocol):
    """A micro-batch (the training loop's ``Batch``) as a dimension that splits each
    sample's tokens over its ranks sees it."""

    def tokens_shape(self) -> tuple[int, int]:
        """(B, T): its samples and their positions (of its token ids [B, T])."""
        ...

    def split_sequence(self, part: Callable[[torch.Tensor], torch.Tensor],
                       positions: torch.Tensor) -> SequenceBatch:
        """This micro-batch as one rank of the split holds it: unshifted labels first
        shifted into targets over the whole sequence, then every [B, T] tensor (model
        inputs, targets) through ``part`` ([B, T, ...] -> [B, T', ...], the rank's
        positions), an all-ones attention mask dropped (any other refused: a rank's
        attention is causal over the whole sequence), and ``positions`` ([B, T'] global
        positions of the rank's tokens) passed as ``position_ids`` unless it has its
        own (split like the rest)."""
        ...


class StepPass(Protocol):
    """How this rank runs one step's micro-batches forward and backward: through its
    module one after another (gradients reduced in the last one's backward), or through
    a pipeline schedule; and a held-out batch forward.

    ``loss(outputs, batch)`` gives (summed loss, loss terms) of a micro-batch;
    ``autocast()`` the forward's precision context; ``loss_scale`` (a 0-dim tensor on the
    device, or None) multiplies the loss before backward (fp16). Nothing is read on the
    host: counts stay tensors. :meth:`forward_backward` adds each micro-batch's summed loss,
    loss terms and positions (a host int: ``batch.positions()``) into ``totals`` ([3],
    float64) and returns the started reduction of the totals (or None) and the
    activation bytes saved for backward, when it measured them.
    ``eval_comm``: the group over which held-out totals are summed.
    """

    eval_comm: Any  # Communicator

    def forward_backward(self, batches: Sequence[Callable[[], Any]], loss: LossOf,
                         totals: torch.Tensor, loss_scale: torch.Tensor | None,
                         autocast: Callable[[], AbstractContextManager[None]],
                         measure: bool) -> tuple[Work | None, int | None]: ...

    def eval_loss(self, batch: Any, loss: LossOf) -> tuple[float, float]: ...


LossOf = Callable[[Any, Any], tuple[torch.Tensor, int]]


class StepTracer(Protocol):
    """The timeline a step records its phases on (``monitor.trace.Tracer`` satisfies
    it): ``span`` around a phase, ``complete`` for a span timed elsewhere."""

    enabled: bool

    def span(self, name: str, lane: str = "main", **args: Any
             ) -> AbstractContextManager[None]: ...

    def complete(self, name: str, start_us: float, end_us: float, lane: str = "main",
                 **args: Any) -> None: ...


class NoTrace:
    """A :class:`StepTracer` that records nothing."""

    enabled = False

    def span(self, name: str, lane: str = "main", **args: Any
             ) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def complete(self, name: str, start_us: float, end_us: float, lane: str = "main",
                 **args: Any) -> None:
        pass
