"""Tensor (Megatron-style) model parallelism over the ``tp`` axis.

``functions`` holds the communication maths (autograd Functions, vocab-parallel
cross-entropy), ``layers`` the sharded modules, ``apply`` the plan-driven swap of a
model's modules and the :class:`TensorParallel` handle the trainer and checkpoints use.
"""

from ..placement import Box
from .apply import (
    STYLES,
    TensorParallel,
    TensorParallelLayoutError,
    apply_tensor_parallel,
    check_divisible,
)
from .functions import (
    column_parallel_linear,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
    vocab_parallel_token_loss,
)
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)

__all__ = [
    "STYLES", "Box", "ColumnParallelLinear", "RowParallelLinear",
    "TensorParallel", "TensorParallelLayoutError", "VocabParallelEmbedding",
    "VocabParallelHead", "apply_tensor_parallel", "check_divisible", "column_parallel_linear",
    "copy_to_tp_region",
    "gather_from_sequence_region", "gather_from_tp_region", "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region", "scatter_to_sequence_region",
    "scatter_to_tp_region", "vocab_parallel_token_loss",
]
