"""How the planner prices pipeline parallelism (``pp``): its candidates and rules, and
the maths of its schedules (pure Python, the schedules of :mod:`.schedules`).

:class:`PipelineStages` is a layout's cut: the layers of each chunk (even, the
remainder on the middle chunks: the ends also hold the embedding and the head), the
micro-batches each stage keeps for backward at its peak (:func:`in_flight`,
:func:`held_mixes`), each chunk's time per micro-batch, the pipelined step with its
bubble, ``(pp - 1) / v`` mean stage times (the zero-bubble schedules: their unit-cost
idle share, ``(pp - 1) / 3m`` of the busy time for zb1), and a simulated step for a
trace. The planner's option ``zb`` picks a zero-bubble schedule (1: zb1, 2: zbv, whose
V of two chunks per rank is ``v = 2``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ...config.schema import ParallelConfig
from ...dimensions import dimension
from ...names import (
    SCHEDULE_1F1B,
    SCHEDULE_GPIPE,
    SCHEDULE_INTERLEAVED,
    SCHEDULE_ZB1,
    SCHEDULE_ZBV,
)
from ...spec import ModelSpec
from ..pricing import LayoutFacts, SearchLimits, ShapeFacts, SimulatedAction
from .check import pipeline_cuts, split_backward_problem, virtual_stages
from .cuts import plan_stages
from .schedules import (
    FORWARD,
    SPLIT_SCHEDULES,
    V_SCHEDULES,
    WEIGHT,
    build_schedule,
    chunk_rank,
    zero_bubble_idle,
)
from .simulate import simulate

ENTRY = dimension("pp")
INTERLEAVED, GPIPE, ONE_F_ONE_B = SCHEDULE_INTERLEAVED, SCHEDULE_GPIPE, SCHEDULE_1F1B
ZERO_BUBBLE = {1: SCHEDULE_ZB1, 2: SCHEDULE_ZBV}  # the planner's option zb


def in_flight(schedule: str, pp: int, m: int, v: int, stage: int) -> int:
    """Micro-batch chunks whose activations pp rank ``stage`` holds at its peak."""
    if pp == 1:
        return 1
    if schedule == GPIPE:
        return m
    if schedule in SPLIT_SCHEDULES:
        return max(sum(mix) for mix in held_mixes(schedule, pp, m, 2 if schedule in
                                                  V_SCHEDULES else 1, stage))
    if schedule == INTERLEAVED:
        return min(m * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1)
    return min(pp - stage, m)


def peak_held_bytes(schedule: str, pp: int, m: int, v: int, stage: int,
                    chunk_bytes: tuple[float, ...]) -> float:
    """The most bytes pp rank ``stage`` holds for backward during a step, when each
    micro-batch of its local chunk L keeps ``chunk_bytes[L]`` from its forward to its
    backward. The peak is not always where the most chunks are held: with v > 1 the
    mix of chunks changes, and the first and last chunk also hold the embedding's and
    the head's activations, and chunks may differ in layers."""
    mixes = held_mixes(schedule, pp, m, v, stage)
    if v == 1:
        return mixes[0][0] * chunk_bytes[0]
    return max(sum(n * b for n, b in zip(mix, chunk_bytes, strict=True)) for mix in mixes)


@functools.lru_cache(maxsize=65536)
def held_mixes(schedule: str, pp: int, m: int, v: int, stage: int
               ) -> tuple[tuple[int, ...], ...]:
    """Micro-batches of each local chunk that pp rank ``stage`` holds at the moments
    one of which is its peak, whatever each chunk's bytes (none held chunk by chunk
    by another).

    After a warmup of w forwards the rank alternates one forward, one backward; its
    j-th forward runs local chunk (j mod pp v) // pp and its j-th backward the mirror
    chunk v - 1 - that. From k to k + 1 backwards the rank adds forward w + k + 1's
    chunk and drops backward k's; both change only every pp steps, so what is held is
    linear in k between those k, and the mixes repeat with period pp v."""
    if pp == 1:
        return ((1,),)  # a plain step: one micro-batch at a time
    if schedule in SPLIT_SCHEDULES:
        return _split_mixes(schedule, pp, m, v, stage)
    if schedule != INTERLEAVED:
        return ((m if schedule == GPIPE else min(pp - stage, m),),)
    total, group = m * v, pp * v
    warmup = min(total, 2 * (pp - stage - 1) + (v - 1) * pp)
    span = min(group, total - warmup)  # the k whose mixes can differ

    def ran(n: int, local: int) -> int:  # of the first n forwards, those of ``local``
        return n // group * pp + min(max(n % group - local * pp, 0), pp)
    if span <= 0:  # every forward is in the warmup
        return (tuple(ran(total, L) for L in range(v)),)
    ks = {0, span - 1, *range(0, span, pp), *range((-warmup - 1) % pp, span, pp)}
    mixes = {tuple(ran(warmup + k + 1, L) - ran(k, v - 1 - L) for L in range(v))
             for k in ks}
    return tuple(a for a in mixes if not any(
        b != a and all(x <= y for x, y in zip(a, b, strict=True)) for b in mixes))


def _split_mixes(schedule: str, pp: int, m: int, v: int, stage: int
                 ) -> tuple[tuple[int, ...], ...]:
    """A zero-bubble schedule's mixes, read off its actions: a micro-batch is held from
    its forward to its W (B keeps the graph for W). The peak is reached by m = pp and
    stays, so at most ``2 pp`` micro-batches are built."""
    built = build_schedule(schedule, pp=pp, m=min(m, 2 * pp), v=v)
    local = [c for c in range(built.n_chunks) if built.rank_of(c) == stage]
    held = [0] * len(local)
    mixes = set()
    for a in built.actions[stage]:
        if a.kind in (FORWARD, WEIGHT):
            held[local.index(a.chunk)] += 1 if a.kind == FORWARD else -1
            mixes.add(tuple(held))
    return tuple(a for a in mixes if not any(
        b != a and all(x <= y for x, y in zip(a, b, strict=True)) for b in mixes))


@functools.lru_cache(maxsize=4096)
def chunk_layers(layers: int, pp: int, v: int) -> tuple[int, ...]:
    """Layers of each of the pp * v chunks: even, the remainder on the middle chunks
    (the ends also hold the embedding and the head)."""
    n = pp * v
    base, extra = divmod(layers, n)
    sizes = [base] * n
    order = sorted(range(n), key=lambda c: (abs(c - (n - 1) / 2), c))
    for c in order[:extra]:
        sizes[c] += 1
    return tuple(sizes)


@functools.lru_cache(maxsize=4096)
def rank_counts(sizes: tuple[int, ...], pp: int, vshape: bool = False) -> tuple[int, ...]:
    """Layers on each pp rank, of chunks of ``sizes`` layers (chunk c on rank c % pp,
    or in a V)."""
    counts = [0] * pp
    for c, size in enumerate(sizes):
        counts[chunk_rank(c, pp, vshape)] += size
    return tuple(counts)


@functools.lru_cache(maxsize=4096)
def _local_chunks(pp: int, v: int, vshape: bool, stage: int) -> Sequence[int]:
    if not vshape:
        return range(stage, pp * v, pp)
    return tuple(c for c in range(pp * v) if chunk_rank(c, pp, vshape) == stage)


class PipelineStages:
    """A layout's layers cut over ``stages`` pp ranks of ``v`` chunks each, run by
    ``schedule`` (interleaved when v > 1, zbv in a V of 2, else 1F1B, GPipe or zb1)."""

    def __init__(self, stages: int, v: int, schedule: str) -> None:
        self.stages, self.v, self.schedule = stages, v, schedule
        self.vshape = schedule in V_SCHEDULES

    @property
    def n_chunks(self) -> int:
        return self.stages * self.v

    def chunk_layers(self, layers: int) -> tuple[int, ...]:
        return chunk_layers(layers, self.stages, self.v)

    def stage_layers(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        return rank_counts(sizes, self.stages, self.vshape)

    def local_chunks(self, stage: int) -> Sequence[int]:
        return _local_chunks(self.stages, self.v, self.vshape, stage)

    def stages_to_estimate(self, sizes: tuple[int, ...], counts: Sequence[int]
                           ) -> list[int]:
        """Past two stages, the largest can only be the first, the last, or the first
        that holds the most layers or the largest chunk (in flight decreases with the
        stage, and the middle stages' parameters depend on their layers only)."""
        if self.stages <= 2:
            return list(range(self.stages))
        # the stage of the largest chunk
        biggest = chunk_rank(sizes.index(max(sizes)), self.stages, self.vshape)
        return sorted({0, self.stages - 1, list(counts).index(max(counts)), biggest})

    def peak_held(self, micro_batches: int, stage: int, chunk_bytes: tuple[float, ...]
                  ) -> float:
        return peak_held_bytes(self.schedule, self.stages, micro_batches, self.v, stage,
                               chunk_bytes)

    def chunk_times(self, sizes: tuple[int, ...], layer_forward: float,
                    layer_backward: float, head: float, ends_forward: tuple[float, float],
                    ends_backward: tuple[float, float]
                    ) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
        """(forward, backward) seconds of one micro-batch on each pp rank's chunks, local
        order; ``sizes``: layers of each global chunk; ``layer_*``: one layer's, with
        its tp communication (and recomputation, backward). The last chunk adds the
        head and loss, a third forward (one of its three matmuls and logit passes) and
        two thirds backward; ``ends_*``: what the (first, last) chunk adds in each
        direction beyond that (tp's communication at the ends)."""
        last = self.n_chunks - 1

        def per_rank(layer: float, head_part: float, ends: tuple[float, float]
                     ) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(sizes[c] * layer + (ends[0] if c == 0 else 0.0)
                               + (head_part + ends[1] if c == last else 0.0)
                               for c in self.local_chunks(r))
                         for r in range(self.stages))

        return (per_rank(layer_forward, head / 3, ends_forward),
                per_rank(layer_backward, head * 2 / 3, ends_backward))

    def messages_per_micro_batch(self) -> int:
        """One activation and one gradient per chunk (none without a cut)."""
        return 2 * self.v if self.stages > 1 else 0

    def step(self, micro_batches: int, per_stage: Sequence[float], message: float
             ) -> tuple[float, float]:
        """m micro-batches at the pace of the slowest stage, plus the bubble:
        ``(pp - 1) / v`` mean stage times (each with its messages); a zero-bubble
        schedule's: its unit-cost idle time over busy time, times m mean stage times
        (zb1: ``(pp - 1) / 3`` of them, the forwards' ramp)."""
        slowest = max(per_stage) + message
        mean = sum(per_stage) / self.stages + message
        if self.schedule in SPLIT_SCHEDULES:
            bubble = zero_bubble_idle(self.schedule, self.stages, micro_batches) * (
                micro_batches * mean)
        else:
            bubble = (self.stages - 1) * mean / self.v
        return micro_batches * slowest + bubble, bubble

    def traced_micro_batches(self, micro_batches: int, max_actions: int) -> int:
        """All, unless that is more than ``max_actions`` forwards and backwards; never
        fewer than ``pp`` (the steady state starts there), a multiple of pp when
        interleaved."""
        per_chunk = 3 if self.schedule in SPLIT_SCHEDULES else 2  # F, B (, W)
        fit = max_actions // (per_chunk * self.v * self.stages)
        if fit >= micro_batches:
            return micro_batches
        if self.schedule == INTERLEAVED:
            fit -= fit % self.stages
        return min(micro_batches, max(fit, self.stages))

    def simulate(self, micro_batches: int, forward: Sequence[float],
                 backward: Sequence[float], message: float
                 ) -> tuple[str, list[list[SimulatedAction]], int]:
        """The schedule run by :func:`.simulate.simulate` with these costs (per global
        chunk, chunk c the local chunk c // stages of stage c % stages: re-indexed here
        for a V)."""
        schedule = build_schedule(self.schedule, pp=self.stages, m=micro_batches, v=self.v)
        if self.vshape:
            forward, backward = self._v_order(forward), self._v_order(backward)
        timeline = simulate(schedule, forward_time=list(forward),
                            backward_time=list(backward), message_time=message)
        ranks = [[SimulatedAction(rank=t.rank, forward=t.action.kind == FORWARD,
                                  symbol=t.action.kind, chunk=t.action.chunk,
                                  micro=t.action.micro, start=t.start, end=t.end)
                  for t in actions] for actions in timeline]
        return schedule.name, ranks, sum(map(len, schedule.actions))

    def _v_order(self, costs: Sequence[float]) -> list[float]:
        """Costs given as chunk ``j * stages + r`` = stage r's j-th local chunk, as the
        V's global chunks."""
        out = [0.0] * self.n_chunks
        for r in range(self.stages):
            for j, c in enumerate(self.local_chunks(r)):
                out[c] = costs[j * self.stages + r]
        return out


class PipelinePricing:
    """pp's pricing (:class:`~..pricing.StagePricing`)."""

    def candidates(self, ranks: int, limits: SearchLimits) -> list[int]:
        return [d for d in range(1, ranks + 1) if ranks % d == 0]

    def option_values(self, name: str, degree: int, limits: SearchLimits) -> Sequence[int]:
        if name == "v":
            return range(1, limits.max_v + 1) if degree > 1 else (1,)
        if name == "zb":
            return (0, *ZERO_BUBBLE) if degree > 1 else (0,)
        return (0,)  # gpipe: set by hand (--layout), never searched

    def options_problem(self, planned: LayoutFacts) -> str | None:
        """Interleaving, GPipe and the zero-bubble schedules each take some (pp, v)."""
        pp, v, gpipe = planned.degree(ENTRY.key), planned.option("v"), planned.option("gpipe")
        zb = planned.option("zb")
        if v > 1 and pp == 1:
            return "interleaving needs pp > 1"
        if gpipe and (pp == 1 or v > 1):
            return "gpipe needs pp > 1 and v = 1"
        if zb and (pp == 1 or gpipe or zb not in ZERO_BUBBLE or v != zb):
            return "zero bubble needs pp > 1, no gpipe, and v = 1 (zb1) or 2 (zbv)"
        return None

    def problem(self, shape: ShapeFacts, planned: LayoutFacts, limits: SearchLimits
                ) -> str | None:
        if planned.degree(ENTRY.key) * planned.option("v") > shape.layers:
            return "pp x v exceeds the layers"
        return self.options_problem(planned)

    def batch_problem(self, planned: LayoutFacts, micro_batches: int) -> str | None:
        pp = planned.degree(ENTRY.key)
        if planned.option("v") > 1 and not planned.option("zb") and micro_batches % pp:
            return "interleaved needs micro-batches divisible by pp"
        if split_backward_problem(ZERO_BUBBLE.get(planned.option("zb"), ""), planned.zero,
                                  planned.recompute != "none"):
            return "zero bubble with recomputation under ZeRO-3"
        return None

    def options_from_config(self, parallel: ParallelConfig, degree: int) -> dict[str, int]:
        zb = next((k for k, name in ZERO_BUBBLE.items() if name == parallel.pp_schedule), 0)
        return {"v": virtual_stages(parallel) if degree > 1 else 1,
                "gpipe": int(degree > 1 and parallel.pp_schedule == SCHEDULE_GPIPE),
                "zb": zb if degree > 1 else 0}

    def config_values(self, planned: LayoutFacts) -> dict[str, object]:
        pp, v = planned.degree(ENTRY.key), planned.option("v")
        values: dict[str, object] = {"pp": pp}
        if pp > 1:
            values["pp_schedule"] = self.cut(planned).schedule
            if v > 1 and not planned.option("zb"):
                values["pp_virtual"] = v
        return values

    def cut(self, planned: LayoutFacts) -> PipelineStages:
        v, zb = planned.option("v"), planned.option("zb")
        schedule = (ZERO_BUBBLE[zb] if zb in ZERO_BUBBLE else INTERLEAVED if v > 1
                    else GPIPE if planned.option("gpipe") else ONE_F_ONE_B)
        return PipelineStages(planned.degree(ENTRY.key), v, schedule)

    def run_chunks(self, parallel: ParallelConfig, spec: ModelSpec, stages: int
                   ) -> tuple[int, ...]:
        """As :func:`.stages.plan_stages` cuts the model (``parallel.pp_split``, or
        balanced by the spec's costs)."""
        cut = plan_stages(spec, pp=stages, v=virtual_stages(parallel),
                          cuts=pipeline_cuts(parallel, spec),
                          vshape=parallel.pp_schedule in V_SCHEDULES)
        return tuple(b - a for a, b in zip(cut.bounds, cut.bounds[1:], strict=False))


PRICING = PipelinePricing()
