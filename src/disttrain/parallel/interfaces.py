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

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


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

    grad_replicas: int

    def zero_grad(self) -> None:
        """Start a step: gradients zero."""

    def no_sync(self) -> AbstractContextManager[None]:
        """A backward pass whose gradients are only accumulated (not the step's last)."""

    def backward(self, scope: int, last: bool) -> AbstractContextManager[None]:
        """One backward pass of pipeline chunk ``scope`` (0 without a pipeline);
        ``last``: the chunk's last backward of the step."""

    def reduce_loss_totals(self, totals: torch.Tensor) -> Work | None:
        """Start summing ``totals`` ([summed loss, loss terms], float64) over the ranks
        whose gradients are summed with this one's; None if none are."""

    def finish_gradient_sync(self, scale: float) -> None:
        """Complete the reductions; gradients become ``scale`` x their global sum."""

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, the gradient data this rank holds for it) after the sync."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global gradient norm; gradients clipped to ``max_norm`` if it is > 0."""

    def after_optimizer_step(self) -> None:
        """Whatever the optimizer's update must be followed by (e.g. all-gathers)."""

    def after_skipped_step(self) -> None:
        """A step whose update was not applied (its loss or gradients were nan / inf):
        clear whatever those gradients reached (a codec's error-feedback state)."""

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""

    def comm_stats(self) -> dict[str, float]:
        """Figures of the last gradient sync for the metrics (may be empty)."""

    def finalize(self) -> None:
        """End of training: the model is left plain, with its full parameters."""


@dataclass(frozen=True)
class StatePiece:
    """A box of a global tensor of the training state, held by this rank.

    ``name``: ``model/<parameter>`` or ``optim/<parameter>/<key>``; ``global_shape`` and
    ``offsets``: where the box lies (``()`` for a scalar); ``tensor``: its data (a view
    that the checkpoint copies); ``eager``: changes during the forward pass (buffers),
    so an asynchronous save copies it at once.
    """

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    eager: bool = False

    @property
    def is_whole(self) -> bool:
        return tuple(self.tensor.shape) == tuple(self.global_shape) and \
            not any(self.offsets)


class TensorSource(Protocol):
    """Global tensors by name (a checkpoint's reader)."""

    def names(self, prefix: str = "") -> list[str]: ...

    def tensor(self, name: str) -> torch.Tensor: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


@runtime_checkable
class PartialSource(Protocol):
    """A :class:`TensorSource` that can read parts of its tensors only: told the boxes
    (global offsets, sizes) this rank holds of each ``model/<name>``, its ``tensor``
    returns tensors of the whole shape in which only those boxes hold values."""

    def want(self, boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
             ) -> None: ...


@runtime_checkable
class ShardedState(Protocol):
    """The training state this rank owns."""

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """The optimizer's parameter groups (matrices decayed, the rest not)."""

    def state_pieces(self, optimizer: torch.optim.Optimizer) -> list[StatePiece]:
        """The pieces this rank saves; over all ranks they cover the state once."""

    def load_state(self, source: TensorSource, optimizer: torch.optim.Optimizer) -> None:
        """Load this rank's part of the state (and the optimizer's) from global tensors
        saved in any layout."""
