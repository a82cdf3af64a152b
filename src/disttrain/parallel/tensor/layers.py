"""Tensor-parallel layers: each holds this rank's shard of a full layer's weights.

Each layer is built from the full (unsharded) module, identical on every tp rank, and
cuts its shard from it, so the tp layers together compute exactly what the full layer
computes. Each reports, per local parameter, the :class:`Box` es that place it in the
global tensor (``param_boxes``), and which of its parameters get only a partial
gradient on each rank (``partial_grad_params``).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.collectives import Communicator
from ..placement import Box, whole_box
from .functions import (
    column_parallel_linear,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)


def dim_boxes(global_shape: tuple[int, ...], dim: int, rank: int, size: int,
              parts: int = 1) -> list[Box]:
    """Rank ``rank`` of ``size``'s boxes when ``dim`` is sharded.

    With ``parts`` > 1 the dim is ``parts`` equal consecutive blocks (the q, k and v
    rows of a fused projection) and each block is sharded on its own: the local tensor
    is this rank's slice of block 0, then of block 1, ... (one box per block).
    """
    n = global_shape[dim]
    if n % (parts * size):
        raise ValueError(f"dim {dim} of size {n} cannot be cut into {parts} part(s) x "
                         f"tp={size} equal shards: make it a multiple of {parts * size}")
    block, shard = n // parts, n // (parts * size)
    shape = tuple(shard if d == dim else s for d, s in enumerate(global_shape))

    def at(offset: int) -> tuple[int, ...]:
        return tuple(offset if d == dim else 0 for d in range(len(global_shape)))

    return [Box(local_offsets=at(j * shard), global_offsets=at(j * block + rank * shard),
                shape=shape, global_shape=tuple(global_shape)) for j in range(parts)]


def local_shape(boxes: list[Box]) -> tuple[int, ...]:
    """The local tensor's shape: the extent the boxes cover."""
    return tuple(max(b.local_offsets[d] + b.shape[d] for b in boxes)
                 for d in range(len(boxes[0].shape)))


def cut(full: torch.Tensor, boxes: list[Box]) -> torch.Tensor:
    """This rank's local tensor, copied out of the ``full`` global tensor."""
    if tuple(full.shape) != boxes[0].global_shape:
        raise ValueError(f"global tensor has shape {tuple(full.shape)}, the boxes "
                         f"describe {boxes[0].global_shape}")
    local = full.new_empty(local_shape(boxes))
    for b in boxes:
        local[b.local_slices()] = full[b.global_slices()]
    return local


def _shard_param(full: torch.Tensor, boxes: list[Box]) -> nn.Parameter:
    return nn.Parameter(cut(full.detach(), boxes), requires_grad=full.requires_grad)


def _shard_optional(full: torch.Tensor | None, boxes: list[Box]) -> nn.Parameter | None:
    return None if full is None else _shard_param(full, boxes)


def _weight_and_bias(full: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A full linear-like layer's ``weight`` and ``bias`` (None when it has none).
    The casts only restate what they are: nn.Module's stubs type every registered
    parameter read through ``__getattr__`` as ``Tensor | Module``."""
    return cast(torch.Tensor, full.weight), cast("torch.Tensor | None", full.bias)


class ShardedModule(nn.Module):
    """A module holding tensor-parallel shards: it says where its parameters lie in the
    global tensors and which of them receive partial gradients."""

    def param_boxes(self) -> dict[str, list[Box]]:
        """Parameter name (local to the module) -> its boxes in the global tensor."""
        return {}

    def partial_grad_params(self) -> list[nn.Parameter]:
        """Replicated parameters whose gradients are partial sums over tp."""
        return []


class ColumnParallelLinear(ShardedModule):
    """y_local = x @ W_local^T + b_local, output sharded on its last dim.

    weight: [out/tp, in], sharded on dim 0; bias: [out/tp]. With ``parts`` > 1 the
    output is ``parts`` equal blocks (q | k | v) each sharded on its own, so the local
    rows are [q_r; k_r; v_r]. Input [B, T, in] replicated (identity forward,
    all-reduce backward), or [B, T/tp, in] under sequence parallelism (all-gathered
    along T forward, reduce-scattered backward). Output [B, T, out/tp]. The backward's
    collective overlaps the weight-gradient matmul (:func:`column_parallel_linear`).

    ``transposed``: the full module stores its weight as [in, out] and computes
    x @ W + b (GPT-2's ``Conv1D``); the shard keeps that layout ([in, out/tp], sharded
    on dim 1), so checkpoints hold the module's own shapes.
    """

    def __init__(self, full: nn.Module, comm: Communicator, *, parts: int = 1,
                 sequence_parallel: bool = False, transposed: bool = False) -> None:
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.transposed = transposed
        weight, bias = _weight_and_bias(full)
        shape = tuple(weight.shape)
        out_dim = 1 if transposed else 0
        self._boxes = {"weight": dim_boxes(shape, out_dim, comm.rank, comm.size, parts)}
        if bias is not None:
            self._boxes["bias"] = dim_boxes(shape[out_dim:out_dim + 1], 0, comm.rank,
                                            comm.size, parts)
        self.in_features = shape[1 - out_dim]
        self.out_features = shape[out_dim] // comm.size
        self.weight = _shard_param(weight, self._boxes["weight"])
        self.bias = _shard_optional(bias, self._boxes.get("bias", []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.comm,
                                      sequence_parallel=self.sequence_parallel,
                                      transposed=self.transposed)

    def param_boxes(self) -> dict[str, list[Box]]:
        return dict(self._boxes)

    def partial_grad_params(self) -> list[nn.Parameter]:
        return []

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out_local={self.out_features}, tp={self.comm.size}, "
                f"sequence_parallel={self.sequence_parallel}, transposed={self.transposed}")


def _as_linear(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The [out, in] weight F.linear takes (a view when stored [in, out])."""
    return weight.t() if transposed else weight


class RowParallelLinear(ShardedModule):
    """y = sum over ranks of (x_local @ W_local^T), then + b.

    weight: [out, in/tp], sharded on dim 1; bias: [out], replicated, added once after
    the reduction. Input [B, T, in/tp] (sharded on its last dim, as a column-parallel
    layer leaves it). Output [B, T, out] all-reduced, or [B, T/tp, out]
    reduce-scattered along T under sequence parallelism (then each rank adds the bias
    to its own positions only, so the bias gradient is partial per rank).
    ``transposed``: as for :class:`ColumnParallelLinear` (weight [in/tp, out], dim 0).
    """

    def __init__(self, full: nn.Module, comm: Communicator, *,
                 sequence_parallel: bool = False, transposed: bool = False) -> None:
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.transposed = transposed
        weight, bias = _weight_and_bias(full)
        shape = tuple(weight.shape)
        in_dim = 0 if transposed else 1
        self._boxes = {"weight": dim_boxes(shape, in_dim, comm.rank, comm.size)}
        if bias is not None:
            self._boxes["bias"] = whole_box(tuple(bias.shape))
        self.in_features = shape[in_dim] // comm.size
        self.out_features = shape[1 - in_dim]
        self.weight = _shard_param(weight, self._boxes["weight"])
        self.bias = _shard_optional(bias, self._boxes.get("bias", []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, _as_linear(self.weight, self.transposed))
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.comm)
        else:
            y = reduce_from_tp_region(y, self.comm)
        return y if self.bias is None else y + self.bias

    def param_boxes(self) -> dict[str, list[Box]]:
        return dict(self._boxes)

    def partial_grad_params(self) -> list[nn.Parameter]:
        return [self.bias] if self.sequence_parallel and self.bias is not None else []

    def extra_repr(self) -> str:
        return (f"in_local={self.in_features}, out={self.out_features}, tp={self.comm.size}, "
                f"sequence_parallel={self.sequence_parallel}, transposed={self.transposed}")


class VocabParallelEmbedding(ShardedModule):
    """Token ids [B, T] -> [B, T, d], the table sharded by vocabulary rows.

    weight: [V/tp, d], rows [r*V/tp, (r+1)*V/tp) of the full table on rank r. Ids
    outside this rank's rows look up zeros; the partial outputs are all-reduced
    (identity backward: each rank's rows get their own tokens' gradient). A
    ``padding_idx`` row gets no gradient, as in the full embedding (on the rank that
    holds it).
    """

    def __init__(self, full: nn.Embedding, comm: Communicator) -> None:
        super().__init__()
        if full.max_norm is not None:
            raise ValueError("VocabParallelEmbedding does not support max_norm: build "
                             "the embedding without it")
        self.comm = comm
        shape = tuple(full.weight.shape)
        self._boxes = {"weight": dim_boxes(shape, 0, comm.rank, comm.size)}
        self.num_local = shape[0] // comm.size
        self.vocab_start = comm.rank * self.num_local
        pad = full.padding_idx
        local_pad = None if pad is None else pad - self.vocab_start
        self.padding_idx = (local_pad if local_pad is not None
                            and 0 <= local_pad < self.num_local else None)
        self.weight = _shard_param(full.weight, self._boxes["weight"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight,
                          padding_idx=self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.comm)

    def param_boxes(self) -> dict[str, list[Box]]:
        return dict(self._boxes)

    def partial_grad_params(self) -> list[nn.Parameter]:
        return []

    def extra_repr(self) -> str:
        return (f"vocab_local={self.num_local}, start={self.vocab_start}, "
                f"tp={self.comm.size}")


class VocabParallelHead(ColumnParallelLinear):
    """The output projection, sharded by vocabulary: [B, T, d] -> local logits
    [B, T, V/tp] (vocabulary ids [r*V/tp, (r+1)*V/tp) on rank r), never gathered.

    weight: [V/tp, d], sharded on dim 0. When the full head is tied to an embedding
    that is itself vocab-sharded, pass that embedding's shard as ``tied`` and the head
    uses the very same Parameter (same rows, one gradient). Input as for
    :class:`ColumnParallelLinear` (replicated, or [B, T/tp, d] under sequence
    parallelism).
    """

    def __init__(self, full: nn.Linear, comm: Communicator, *,
                 tied: nn.Parameter | None = None, sequence_parallel: bool = False) -> None:
        super().__init__(full, comm, sequence_parallel=sequence_parallel)
        if tied is not None:
            if tuple(tied.shape) != tuple(self.weight.shape):
                raise ValueError(f"tied shard has shape {tuple(tied.shape)}, the head's "
                                 f"shard is {tuple(self.weight.shape)}")
            self.weight = tied
