"""Every valid layout of a model on a cluster, ranked by predicted step time.

A layout is kept when it follows disttrain's rules and fits in memory by its own
estimate; every other one is counted under the reason it was dropped (the first rule it
breaks, or "does not fit", with by how much at most). Memory is estimated before time,
so the search over a trillion-parameter model on thousands of devices stays fast.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import UserError
from .cluster import Cluster
from .estimate import Estimate, estimate
from .layout import RECOMPUTE, PlannedLayout
from .options import DEFAULT_OPTIONS, Options
from .shape import ModelShape

_GIB = 2**30


@dataclass
class SearchResult:
    rows: list[Estimate]
    considered: int = 0
    rejected: Counter = field(default_factory=Counter)
    worst_overflow_gib: float = 0.0
    least_overflow_gib: float = 0.0

    def rejections(self) -> dict[str, int]:
        return dict(self.rejected.most_common())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(shape: ModelShape, cluster: Cluster, lay: PlannedLayout,
                   global_batch: int) -> str | None:
    """The first of disttrain's rules ``lay`` breaks for this model, cluster and
    batch (a short reason, used to count rejections), or None."""
    n = cluster.n_devices
    if lay.ranks != n:
        return f"tp x pp x dp != {n} devices"
    if shape.heads % lay.tp:
        return "tp does not divide the heads"
    if shape.kv % lay.tp:
        return "tp does not divide the kv heads"
    if shape.ffn_width % lay.tp:
        return "tp does not divide the MLP width"
    if shape.vocab % lay.tp:
        return "tp does not divide the vocabulary"
    if lay.tp > cluster.gpus_per_node:
        return "tp spans nodes"
    if lay.sp and lay.tp == 1:
        return "sp needs tp > 1"
    if lay.sp and shape.seq % lay.tp:
        return "tp does not divide the sequence (sp)"
    if lay.pp * lay.v > shape.layers:
        return "pp x v exceeds the layers"
    if lay.v > 1 and lay.pp == 1:
        return "interleaving needs pp > 1"
    if lay.gpipe and (lay.pp == 1 or lay.v > 1):
        return "gpipe needs pp > 1 and v = 1"
    if lay.zero and lay.dp == 1:
        return "ZeRO needs dp > 1"
    if global_batch % (lay.dp * lay.mbs):
        return "dp x mbs does not divide the global batch"
    m = lay.micro_batches(global_batch)
    if lay.v > 1 and m % lay.pp:
        return "interleaved needs micro-batches divisible by pp"
    if lay.recompute not in RECOMPUTE:
        return "unknown recompute"
    return None


def candidates(shape: ModelShape, cluster: Cluster, global_batch: int, *,
               max_v: int = 8, max_mbs: int = 16,
               recompute: tuple[str, ...] = RECOMPUTE) -> Iterator[PlannedLayout]:
    """Every (tp, pp, dp, v, mbs, zero, recompute, sp) whose degrees multiply to the
    cluster's size: tp over the divisors up to a node, mbs over powers of two."""
    n = cluster.n_devices
    mbs_options = [b for b in (1, 2, 4, 8, 16, 32) if b <= max_mbs]
    for tp in _divisors(n):
        if tp > cluster.gpus_per_node:
            continue
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            vs = [1] if pp == 1 else range(1, max_v + 1)
            for v, mbs, zero, rc, sp in itertools.product(
                    vs, mbs_options, range(4), recompute, (False, True)):
                if sp and tp == 1:
                    continue
                yield PlannedLayout(tp=tp, pp=pp, dp=dp, v=v, mbs=mbs, zero=zero,
                                    recompute=rc, sp=sp)


def search(shape: ModelShape, cluster: Cluster, global_batch: int,
           options: Options = DEFAULT_OPTIONS, *, top: int = 5,
           recompute: tuple[str, ...] = RECOMPUTE) -> SearchResult:
    """The ``top`` fastest layouts that fit, and why the others were dropped."""
    if global_batch < 1:
        raise UserError(f"--global-batch {global_batch} must be at least 1")
    result = SearchResult(rows=[])
    kept: list[Estimate] = []
    least = None
    for lay in candidates(shape, cluster, global_batch, recompute=recompute):
        result.considered += 1
        problem = layout_problem(shape, cluster, lay, global_batch)
        if problem:
            result.rejected[problem] += 1
            continue
        est = estimate(shape, cluster, lay, global_batch, options, memory_only=True)
        if not est.fits:
            over = (est.memory_bytes - cluster.memory_gib * _GIB) / _GIB
            least = over if least is None else min(least, over)
            result.worst_overflow_gib = max(result.worst_overflow_gib, over)
            result.rejected["does not fit in memory"] += 1
            continue
        kept.append(estimate(shape, cluster, lay, global_batch, options))
    kept.sort(key=lambda e: (e.step_time_s, e.memory_bytes))
    result.rows = kept[:top] if top > 0 else kept
    result.least_overflow_gib = least or 0.0
    return result
