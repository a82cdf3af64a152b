"""LoRA-adapted linear layers under tensor parallelism: the adapter split with its layer.

A :class:`~disttrain.adapters.LoRALinear` y = W x + s B A x (A [r, in], B [out, r],
s = alpha / r) becomes the tensor-parallel layer of its plan style, with the adapter cut
so that the layer's own collective carries it and nothing else is exchanged
(:data:`~disttrain.spec.ADAPTER_KINDS`):

- column-parallel (W's output rows sharded): A whole, B's rows sharded like W's
  (q | k | v blocks each on their own for a fused projection); both paths read the
  input after the one region entry, so the input gradient's single all-reduce (or
  reduce-scatter under sequence parallelism) sums both. A's gradient, from this rank's
  rows of B only, is a partial sum over tp (summed after the backward);
- row-parallel (W's input columns sharded): A's columns sharded like W's, B whole; each
  rank adds s B (A_r x_r) to its partial output before the one all-reduce (or
  reduce-scatter), which sums it with the rest. B's gradient is a partial sum.

Parameter names stay the adapted model's canonical ones: ``<path>.weight`` / ``.bias``
(the base's, frozen as they were), ``<path>.lora_A.weight``, ``<path>.lora_B.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...adapters import LoRALinear
from ...comm.collectives import Communicator
from ...spec import TP_COLWISE_QKV, TP_ROWWISE
from ..placement import Box, whole_box
from .functions import (
    copy_to_tp_region,
    gather_from_sequence_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)
from .layers import ColumnParallelLinear, RowParallelLinear, ShardedModule, cut, dim_boxes


class AdapterShard(ShardedModule):
    """This rank's part of one adapter factor: ``weight`` (cut by ``boxes`` from the full
    factor); ``partial``: its gradient is a partial sum over tp. It computes nothing
    itself: the adapted layer multiplies by its weight."""

    def __init__(self, full: torch.Tensor, boxes: list[Box], partial: bool) -> None:
        super().__init__()
        self._boxes, self._partial = boxes, partial
        self.weight = nn.Parameter(cut(full.detach(), boxes), requires_grad=full.requires_grad)

    def param_boxes(self) -> dict[str, list[Box]]:
        return {"weight": list(self._boxes)}

    def partial_grad_params(self) -> list[nn.Parameter]:
        return [self.weight] if self._partial else []


def _update(x: torch.Tensor, a: AdapterShard, b: AdapterShard, dropout: nn.Module,
            scaling: float) -> torch.Tensor:
    """s B A dropout(x) with this rank's factors."""
    return F.linear(F.linear(dropout(x), a.weight), b.weight) * scaling


class ColumnParallelLoRALinear(ColumnParallelLinear):
    """A column-parallel adapted layer: y_r = x @ W_r^T + b_r + s (B_r A x), output
    [..., out/tp] sharded on its last dim.

    weight: [out/tp, in] (or [in, out/tp] ``transposed``), frozen as the base was;
    lora_A.weight: [r, in], whole (gradient partial over tp); lora_B.weight: [out/tp, r],
    its rows cut as the weight's (``parts`` blocks). Input as for
    :class:`~.layers.ColumnParallelLinear`: replicated [..., in], or [B, T/tp, in] under
    sequence parallelism (all-gathered along T)."""

    def __init__(self, adapted: LoRALinear, comm: Communicator, *, parts: int = 1,
                 sequence_parallel: bool = False, transposed: bool = False) -> None:
        super().__init__(adapted.base_layer, comm, parts=parts,
                         sequence_parallel=sequence_parallel, transposed=transposed)
        a, b = adapted.lora_A.weight, adapted.lora_B.weight
        self.lora_A = AdapterShard(a, whole_box(tuple(a.shape)), partial=True)
        self.lora_B = AdapterShard(b, dim_boxes(tuple(b.shape), 0, comm.rank, comm.size,
                                                parts), partial=False)
        self.lora_dropout, self.scaling = adapted.lora_dropout, adapted.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = (gather_from_sequence_region(x, self.comm) if self.sequence_parallel
                else copy_to_tp_region(x, self.comm))
        w = self.weight.t() if self.transposed else self.weight
        y = F.linear(full, w, self.bias)
        return y + _update(full, self.lora_A, self.lora_B, self.lora_dropout, self.scaling)


class RowParallelLoRALinear(RowParallelLinear):
    """A row-parallel adapted layer: y = sum over ranks of (x_r @ W_r^T + s B A_r x_r),
    then + b.

    weight: [out, in/tp] (or [in/tp, out] ``transposed``), frozen as the base was;
    lora_A.weight: [r, in/tp], its columns cut as the weight's; lora_B.weight: [out, r],
    whole (gradient partial over tp). Input [..., in/tp]; output as for
    :class:`~.layers.RowParallelLinear` (all-reduced, or reduce-scattered along T under
    sequence parallelism)."""

    def __init__(self, adapted: LoRALinear, comm: Communicator, *,
                 sequence_parallel: bool = False, transposed: bool = False) -> None:
        super().__init__(adapted.base_layer, comm, sequence_parallel=sequence_parallel,
                         transposed=transposed)
        a, b = adapted.lora_A.weight, adapted.lora_B.weight
        self.lora_A = AdapterShard(a, dim_boxes(tuple(a.shape), 1, comm.rank, comm.size),
                                   partial=False)
        self.lora_B = AdapterShard(b, whole_box(tuple(b.shape)), partial=True)
        self.lora_dropout, self.scaling = adapted.lora_dropout, adapted.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.t() if self.transposed else self.weight
        y = F.linear(x, w) + _update(x, self.lora_A, self.lora_B, self.lora_dropout,
                                     self.scaling)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.comm)
        else:
            y = reduce_from_tp_region(y, self.comm)
        return y if self.bias is None else y + self.bias


def adapted_layer(style: str, adapted: LoRALinear, comm: Communicator, *,
                  sequence_parallel: bool, transposed: bool
                  ) -> ColumnParallelLinear | RowParallelLinear:
    """The tensor-parallel form of ``adapted`` under plan style ``style`` (``colwise``,
    ``colwise_qkv`` or ``rowwise``)."""
    if style == TP_ROWWISE:
        return RowParallelLoRALinear(adapted, comm, sequence_parallel=sequence_parallel,
                                     transposed=transposed)
    return ColumnParallelLoRALinear(adapted, comm, parts=3 if style == TP_COLWISE_QKV else 1,
                                    sequence_parallel=sequence_parallel,
                                    transposed=transposed)
