"""Tensor parallelism as a dimension of the layout (entry ``tp`` of
:data:`disttrain.dimensions.DIMENSIONS`): what it applies to a model replica, and its
part of the composed model.

:func:`apply_tensor_dimension` shards the model in place over the ``tp`` axis by its
spec's plan (:func:`~.apply.apply_tensor_parallel`); the :class:`TensorShards` it returns
gives the composition this rank's boxes of every parameter (the Placement's sharding
group: a parameter replicated over tp is written by tp rank 0 and weighs 1/tp in the
global norm), the partial gradients summed over tp after the reduction, the first
step's proof that the plan's identical gradients are identical
(:func:`check_identical_grads`), the sequence-parallel activation length, and the
vocabulary-parallel loss where the head is sharded (the loss counted on tp rank 0: every
tp rank computes the same one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...comm import Communicator
from ...errors import TensorParallelGradientError
from ...spec import IDENTICAL
from ..applied import AppliedDimension, ApplyContext
from ..placement import Placement
from .apply import TensorParallel, apply_tensor_parallel
from .check import ENTRY

__all__ = ["ENTRY", "TensorShards", "apply_tensor_dimension", "check_identical_grads"]


class TensorShards(AppliedDimension):
    """This rank's tensor-parallel shard of the model (``tp``: what the swap did);
    ``check_grads``: prove the plan's identical gradients at the first step."""

    def __init__(self, tp: TensorParallel, model: nn.Module, check_grads: bool) -> None:
        self.tp, self.model = tp, model
        self.check_pending = check_grads

    def describe(self) -> str:
        return f"1/{self.tp.comm.size} of each matrix (tp shard {self.tp.comm.rank})"

    @property
    def counts_loss(self) -> bool:
        return self.tp.comm.rank == 0

    def place(self, placement: Placement) -> Placement:
        """Boxes from the swap; every parameter not sharded is replicated over tp."""
        tp = self.tp
        replicated = {id(p) for p in self.model.parameters() if not tp.is_sharded(p)}
        return dataclasses.replace(
            placement, replicated=replicated, shard_rank=tp.comm.rank,
            shards=tp.comm.size, boxes_fn=lambda n, p: tp.boxes(n),
            to_local_fn=tp.local_from_global)

    def fix_gradients(self, pieces: dict[int, torch.Tensor]) -> None:
        """Sequence parallelism's (and ``partial`` modules') partial sums over tp."""
        self.tp.sync_replicated_grads([pieces[id(p)] for p in self.tp.partial_params
                                       if id(p) in pieces])

    def check_first_step(self, pieces: list[tuple[nn.Parameter, torch.Tensor]],
                         placement: Placement, world: Communicator) -> None:
        if self.check_pending:
            self.check_pending = False
            check_identical_grads(self.tp, placement, pieces, world)

    def activation_length(self, seq_len: int) -> int:
        """Sequence parallelism keeps the activations split over tp between blocks."""
        return seq_len // self.tp.comm.size if self.tp.sequence_parallel else seq_len

    def token_loss(self) -> Callable[..., Any] | None:
        return self.tp.token_loss if self.tp.vocab_sharded else None

    def full_logits_loss(self, loss_fn: Callable[[Any, Any], Any]
                         ) -> Callable[[Any, Any], Any]:
        return self.tp.full_logits_loss(loss_fn) if self.tp.vocab_sharded else loss_fn


def apply_tensor_dimension(model: nn.Module, ctx: ApplyContext) -> TensorShards:
    """Shard ``model`` (identically initialised on every rank) over ``ctx.comm``."""
    tp = apply_tensor_parallel(model, ctx.comm, spec=ctx.spec,
                               sequence_parallel=ctx.parallel.sequence_parallel)
    return TensorShards(tp, model, ctx.parallel.tp_check_grads)


def check_identical_grads(tp: TensorParallel, placement: Placement,
                          pieces: list[tuple[nn.Parameter, torch.Tensor]],
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
    checked = [(placement.name(p), g) for p, g in pieces]
    checked = [(name, g) for name, g in checked if tp.kind(name) == IDENTICAL]
    tp_comm, bad = tp.comm, None
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
