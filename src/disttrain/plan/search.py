"""Every valid layout of a model on a cluster, ranked by predicted step time.

A layout is kept when it follows disttrain's rules and fits in memory by its own
estimate; every other one is counted under the reason it was dropped (the first rule it
breaks, or "does not fit", with by how much at most). Memory is estimated before time,
so the search over a trillion-parameter model on thousands of devices stays fast.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..dimensions import DIMENSIONS, Dimension, Role, joined, plan_order, with_role
from ..errors import UserError
from ..parallel.dimensions import behaviour
from ..parallel.pricing import DimensionPricing, SearchLimits
from ..shape import ModelShape
from .cluster import Cluster
from .estimate import Estimate, estimate, memory_floor, with_step_time
from .layout import OPTIONS, RECOMPUTE, PlannedLayout
from .options import DEFAULT_OPTIONS, Options

_GIB = 2**30
ZERO_STAGES = (0, 1, 2, 3)


@dataclass
class SearchResult:
    """The kept ``rows`` (fastest first), how many layouts were ``considered``, and the
    ``rejected`` by reason; of those that do not fit, the ``least_overflow_gib`` (exact)
    and the ``worst_overflow_gib`` (at least: a layout whose model states alone miss by
    more than the closest miss is not estimated further)."""

    rows: list[Estimate]
    considered: int = 0
    rejected: Counter = field(default_factory=Counter)
    worst_overflow_gib: float = 0.0
    least_overflow_gib: float = 0.0

    def rejections(self) -> dict[str, int]:
        return dict(self.rejected.most_common())


def layout_problem(shape: ModelShape, cluster: Cluster, planned: PlannedLayout,
                   global_batch: int) -> str | None:
    """The first of disttrain's rules ``planned`` breaks for this model, cluster and
    batch (a short reason, used to count rejections), or None: the device count, each
    dimension's own rules, ZeRO's replicas, the batch's split, each dimension's rules on
    the micro-batches, the recomputation."""
    return (_degrees_problem(shape, cluster, planned)
            or _run_problem(planned, global_batch))


def _degrees_problem(shape: ModelShape, cluster: Cluster, planned: PlannedLayout
                     ) -> str | None:
    """The rules :func:`layout_problem` asks first, which read only the degrees and
    options (the search asks them once for every micro-batch, ZeRO stage and
    recomputation): the device count, each dimension's own rules."""
    n = cluster.n_devices
    if planned.ranks != n:
        return f"{joined(plan_order())} != {n} devices"
    limits = _limits(cluster)
    for pricing in _pricings():
        problem = pricing.problem(shape, planned, limits)
        if problem:
            return problem
    return None


def _run_problem(planned: PlannedLayout, global_batch: int) -> str | None:
    """The rules :func:`layout_problem` asks next: ZeRO's replicas, the batch's split,
    each dimension's rules on the micro-batches, the recomputation."""
    if planned.zero and planned.replicas == 1:
        return f"ZeRO needs {joined(with_role(Role.REPLICAS))} > 1"
    if global_batch % (planned.role(Role.SAMPLES) * planned.mbs):
        return f"{joined(with_role(Role.SAMPLES))} x mbs does not divide the global batch"
    m = planned.micro_batches(global_batch)
    for pricing in _pricings():
        problem = pricing.batch_problem(planned, m)
        if problem:
            return problem
    if planned.recompute not in RECOMPUTE:
        return "unknown recompute"
    return None


@functools.cache
def _pricings() -> tuple[DimensionPricing, ...]:
    """Each dimension's pricing, in label order (the order its rules are asked in)."""
    return tuple(behaviour(d).pricing for d in plan_order())


def _limits(cluster: Cluster, max_v: int = 8) -> SearchLimits:
    return _limits_of(cluster.n_devices, cluster.gpus_per_node, max_v)


@functools.cache
def _limits_of(devices: int, gpus_per_node: int, max_v: int) -> SearchLimits:
    return SearchLimits(devices=devices, gpus_per_node=gpus_per_node, max_v=max_v)


def _degrees(dims: tuple[Dimension, ...], ranks: int, limits: SearchLimits
             ) -> Iterator[dict[str, int]]:
    """Every choice of degrees for ``dims`` (label order) on ``ranks`` devices: each
    dimension over its candidates for what the ones before it leave, the derived one
    the rest."""
    if not dims:
        yield {}
        return
    first, rest = dims[0], dims[1:]
    if first.derived:
        for tail in _degrees(rest, ranks, limits):
            left = ranks // math.prod(tail.values())
            if left * math.prod(tail.values()) == ranks:
                yield {first.key: left, **tail}
        return
    for n in behaviour(first).pricing.candidates(ranks, limits):
        for tail in _degrees(rest, ranks // n, limits):
            yield {first.key: n, **tail}


def candidates(shape: ModelShape, cluster: Cluster, global_batch: int, *,
               max_v: int = 8, max_mbs: int = 16,
               recompute: tuple[str, ...] = RECOMPUTE,
               zero: tuple[int, ...] = ZERO_STAGES) -> Iterator[PlannedLayout]:
    """Every choice of degrees whose product is the cluster's size (each dimension's
    candidates), of each dimension's search keys, of the micro-batch (powers of two),
    the ZeRO stage (among ``zero``) and the recomputation (among ``recompute``); the
    keys vary in label order, the last fastest. A combination of options that a
    dimension's ``options_problem`` rejects (interleaving without a cut, a zero-bubble
    schedule at a v it does not run) is never built: no model or batch makes it valid."""
    limits = _limits(cluster, max_v)
    mbs_options = [b for b in (1, 2, 4, 8, 16, 32) if b <= max_mbs]
    owners = {o.name: d for d in DIMENSIONS for o in d.plan_options}
    planner: dict[str, Sequence[int | str]] = {"mbs": mbs_options, "zero": zero,
                                               "recompute": recompute}
    keys = [k for k, _ in PlannedLayout().items() if k not in {d.key for d in DIMENSIONS}]
    at = {k: i for i, k in enumerate(keys)}
    option_at = [at[o.name] for o in OPTIONS]
    mbs_at, zero_at, recompute_at = at["mbs"], at["zero"], at["recompute"]
    for degrees in _degrees(plan_order(), cluster.n_devices, limits):
        held = tuple(degrees[d.key] for d in DIMENSIONS)
        values = [planner[k] if k in planner else
                  behaviour(owners[k]).pricing.option_values(k, degrees[owners[k].key],
                                                             limits)
                  for k in keys]
        for c in _taken(keys, values, [k not in planner for k in keys], held):
            yield PlannedLayout.of(held, tuple(int(c[i]) for i in option_at),
                                   int(c[mbs_at]), int(c[zero_at]), str(c[recompute_at]))


def _taken(keys: list[str], values: list[Sequence[int | str]], is_option: list[bool],
           held: tuple[int, ...]) -> Iterator[tuple[int | str, ...]]:
    """The product of ``values`` (one sequence per key, the last fastest, in that order)
    less the combinations of options that a dimension's ``options_problem`` rejects at
    the degrees ``held``: those are never built. The accepted options form a tree over
    the runs of consecutive option keys, walked with the planner's keys between."""
    runs = [list(run) for _, run in itertools.groupby(range(len(keys)),
                                                      key=is_option.__getitem__)]
    option_keys = [k for k, o in zip(keys, is_option, strict=True) if o]
    tree: dict = {}
    for combo in itertools.product(*(v for v, o in zip(values, is_option, strict=True)
                                     if o)):
        chosen = dict(zip(option_keys, combo, strict=True))
        probe = PlannedLayout.of(held, tuple(int(chosen[o.name]) for o in OPTIONS), 1, 0,
                                 RECOMPUTE[0])
        if any(p.options_problem(probe) for p in _pricings()):
            continue
        node, at = tree, 0
        for run in runs:
            if is_option[run[0]]:
                node, at = node.setdefault(combo[at:at + len(run)], {}), at + len(run)

    def walk(r: int, node: dict, prefix: tuple) -> Iterator[tuple]:
        if r == len(runs):
            yield prefix
            return
        run = runs[r]
        parts = (node.items() if is_option[run[0]] else
                 ((part, node) for part in itertools.product(*(values[i] for i in run))))
        for part, child in parts:
            yield from walk(r + 1, child, prefix + part)
    return walk(0, tree, ())


def search(shape: ModelShape, cluster: Cluster, global_batch: int,
           options: Options = DEFAULT_OPTIONS, *, top: int = 5,
           recompute: tuple[str, ...] = RECOMPUTE,
           zero: tuple[int, ...] = ZERO_STAGES,
           held: tuple[tuple[str, int], ...] = ()) -> SearchResult:
    """The ``top`` fastest layouts that fit (0: all of them), and why the others were
    dropped; ``recompute`` and ``zero``: the modes and stages a framework offers;
    ``held``: (key, value) of the dimensions and options it does not offer, held at the
    value it runs (``("cp", 1)``, ``("sp", 0)``): the other layouts are not considered."""
    if global_batch < 1:
        raise UserError(f"--global-batch {global_batch} must be at least 1")
    result = SearchResult(rows=[])
    kept: list[Estimate] = []
    least = None
    budget = cluster.memory_gib * _GIB
    floors: dict[tuple, float] = {}  # memory_floor by what it depends on
    by_degrees: dict[tuple, str | None] = {}  # _degrees_problem by what it depends on
    for planned in candidates(shape, cluster, global_batch, recompute=recompute,
                          zero=zero):
        if held and any(_value(planned, key) != value for key, value in held):
            continue
        result.considered += 1
        rules = (planned.degrees, planned.options)
        if rules not in by_degrees:
            by_degrees[rules] = _degrees_problem(shape, cluster, planned)
        problem = by_degrees[rules] or _run_problem(planned, global_batch)
        if problem:
            result.rejected[problem] += 1
            continue
        key = (planned.degrees, planned.options, planned.zero)
        floor = floors.get(key)
        if floor is None:
            floor = floors[key] = memory_floor(shape, cluster, planned, options)
        # the floor is a lower bound of the estimate: above the device, it cannot fit,
        # and unless it could be the closest miss it is not worth estimating
        if floor > budget and least is not None and floor - budget >= least * _GIB:
            result.worst_overflow_gib = max(result.worst_overflow_gib,
                                            (floor - budget) / _GIB)
            result.rejected["does not fit in memory"] += 1
            continue
        est = estimate(shape, cluster, planned, global_batch, options, memory_only=True)
        if not est.fits:
            over = (est.memory_bytes - budget) / _GIB
            least = over if least is None else min(least, over)
            result.worst_overflow_gib = max(result.worst_overflow_gib, over)
            result.rejected["does not fit in memory"] += 1
            continue
        kept.append(with_step_time(est, shape, cluster, global_batch, options))
    kept.sort(key=lambda e: (e.step_time_s, e.memory_bytes))
    result.rows = kept[:top] if top > 0 else kept
    result.least_overflow_gib = least or 0.0
    return result


def _value(planned: PlannedLayout, key: str) -> int:
    """A dimension's degree or a dimension option's value, by its key."""
    if key in {d.key for d in DIMENSIONS}:
        return planned.degree(key)
    if key in {o.name for o in OPTIONS}:
        return planned.option(key)
    raise UserError(f"held key {key!r} is neither a dimension nor a dimension option; "
                    f"use one of {[d.key for d in DIMENSIONS] + [o.name for o in OPTIONS]}")
