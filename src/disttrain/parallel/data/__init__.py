"""Data parallelism as a dimension of the layout (entry ``dp`` of
:data:`disttrain.dimensions.DIMENSIONS`): the home of what is dp's own.

dp applies nothing to a model itself: its ranks hold replicas, and the data-parallel
strategy ``parallel.strategy`` names (:mod:`disttrain.parallel.registry`: ddp, zero,
local, ...) runs over the replica group the roles make (dp today; dp x cp once context
parallelism is declared). Its degree is the one derived from the world and the others'.
"""
