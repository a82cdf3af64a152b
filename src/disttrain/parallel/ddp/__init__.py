"""The ddp strategy (``parallel.strategy = ddp``, the default): whole replicas kept
identical by a bucketed, overlapped gradient all-reduce (:mod:`.data_parallel`).

:data:`DDP` is its registry entry; :func:`apply_data_parallel` is the one way it is
built, by runs (through the entry) and by benches and tests alike.
"""

from __future__ import annotations

import torch

from ...comm.codecs import build_codec
from ...names import STRATEGY_DDP
from ..interfaces import GradSync, ShardedState
from ..replicated import ReplicatedState, check_replica
from ..strategy import WIRE_DTYPES, DataParallelStrategy, StrategyContext
from ..sync.local import LocalGradients
from .data_parallel import DataParallel, apply_data_parallel


def build_ddp(ctx: StrategyContext) -> tuple[GradSync, ShardedState]:
    reduce_dtype = WIRE_DTYPES[ctx.parallel.grad_reduce_dtype]
    codec = build_codec(ctx.comm, ctx.seed)
    grads: GradSync
    if ctx.replicas.size == 1 and codec is None and reduce_dtype == torch.float32:
        # nothing to reduce: the gradients autograd accumulates, as a plain loop's
        # (a lower-precision wire or a codec still rounds them as a larger dp would)
        grads = LocalGradients(ctx.module, ctx.replicas, broadcast=False,
                               zeros_for_unused=True)
        return grads, ReplicatedState(ctx.module, ctx.placement, 0, 1)
    grads = apply_data_parallel(ctx.module, ctx.replicas, bucket_mb=ctx.parallel.bucket_mb,
                                broadcast=not ctx.fresh, tracer=ctx.tracer,
                                reduce_dtype=reduce_dtype, codec=codec)
    return grads, ReplicatedState(ctx.module, ctx.placement, ctx.replicas.rank,
                                  ctx.replicas.size)


DDP = DataParallelStrategy(STRATEGY_DDP, build_ddp, check_replica(STRATEGY_DDP, False))

__all__ = ["DDP", "DataParallel", "apply_data_parallel", "build_ddp"]
