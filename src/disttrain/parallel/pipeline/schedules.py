"""Pipeline schedules as data: each pp rank's ordered list of forward/backward actions.

Pure Python (no torch, no process groups), so the config validator can check a
schedule before any group exists and the planner can simulate one.

The model is cut into ``n = pp * v`` chunks; chunk ``c`` lives on pp rank ``c % pp``
(rank ``r`` holds chunks ``r, r + pp, ..., r + (v-1) pp``), or, in a V (``zbv``), on
rank ``c`` going down and ``2 pp - 1 - c`` coming back (rank 0 holds the first and
the last chunk). An action is ``Action(kind, chunk, micro)``. Sends and receives are
implied:

- ``F(c, i)`` receives micro-batch ``i``'s activation from chunk ``c - 1`` (unless
  ``c == 0``) and sends its output to chunk ``c + 1`` (unless ``c == n - 1``);
- ``B(c, i)`` receives the gradient of its output from chunk ``c + 1`` (unless last)
  and sends the gradient of its input to chunk ``c - 1`` (unless first). In the
  zero-bubble schedules (``split``) B computes only that input gradient;
- ``W(c, i)`` (zero-bubble schedules only) computes the chunk's weight gradients of
  micro-batch ``i`` from what its B kept; no message.

Schedules:

- ``gpipe``: all forwards, then all backwards (m activations alive per stage);
- ``1f1b``: ``pp - r - 1`` warmup forwards, then one forward / one backward, then the
  remaining backwards (at most ``pp - r`` activations alive on rank r);
- ``interleaved``: 1F1B over ``v`` chunks per rank (the idea of Narayanan et al.,
  2021): forwards go through the rank's chunks in groups of ``pp`` micro-batches, so
  the warmup and cooldown are made of chunk-sized (1/v) pieces and the bubble shrinks
  by about ``v``. Needs ``m`` to be a multiple of ``pp``;
- ``zb1`` (ZB-H1 of Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's
  forwards and input gradients (at most ``pp - r`` forwards ahead of the input
  gradients on rank r), the weight gradients deferred into the slots where 1F1B
  idles, at most ``pp`` micro-batches held until their W on any rank (1F1B's peak);
  bubble ``(pp-1) / (3m + pp-1)`` with F = B = W;
- ``zbv`` (ZB-V, Qi et al., 2024, "Pipeline Parallelism with Controllable Memory"):
  two chunks per rank in a V, at most ``2 pp`` chunk activations (``pp`` micro-batches
  of a whole stage, 1F1B's peak) held until W.

``zb1`` is built by running the ranks greedily on unit costs (F = B = W = 1, free
messages): at each moment a free rank runs the first that is ready of a forward within
its limits, an input gradient, a weight gradient. ``zbv`` is the shorter of two orders
in the simulator (a message costing 5% of a chunk's forward, then free messages): the
same greedy run (input gradient first, then a forward within its limit, then W), and the
paper's V: rank r runs ``2(pp-r) - 1`` forwards of its first chunk, r pairs of forwards
(second chunk, first chunk) and ``pp - r`` triples F B W of its second chunk, then
triples F B W of each chunk in turn, then cools down with input gradients and the W's
left. The paper's V puts a W before most input gradients that wait on a message, so
most of a message's latency is hidden (the greedy order has no such slack: at 5%
message cost its bubble at pp 4, m 8 grows from 0.059 to 0.082, the V's to 0.068); it
reaches the
bound of any step that ends in one synchronised optimizer step for every m >= 2pp - 1:
the last rank cannot start before ``pp - 1`` chunk forwards have gone down the V and
every rank does the same work, so the step is at least ``6 m + pp - 1`` chunk units
(the papers' "zero" bubble counts steps without that barrier, whose ramps overlap).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ...names import (
    SCHEDULE_1F1B,
    SCHEDULE_GPIPE,
    SCHEDULE_INTERLEAVED,
    SCHEDULE_ZB1,
    SCHEDULE_ZBV,
    SCHEDULES,
)
from .actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule, chunk_rank
from .simulate import simulate

SPLIT_SCHEDULES = (SCHEDULE_ZB1, SCHEDULE_ZBV)  # backward split into B and W
V_SCHEDULES = (SCHEDULE_ZBV,)  # chunks placed in a V


def validate_schedule(name: str, pp: int, m: int, v: int, n_layer: int) -> None:
    """Raise ValueError (what is wrong, the value, the fix) if the schedule ``name``
    cannot run ``m`` micro-batches on ``pp`` stages with ``v`` chunks per stage of a
    model with ``n_layer`` blocks."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is unknown; use one of {SCHEDULES}")
    for field, value in (("pp", pp), ("micro-batches", m), ("v", v)):
        if value < 1:
            raise ValueError(f"pipeline {field}={value} must be at least 1")
    if name == SCHEDULE_ZBV and v != 2:
        raise ValueError(f"'zbv' runs two chunks per stage (a V) but v={v}; set v=2")
    if name == SCHEDULE_ZBV and pp < 2:
        raise ValueError(f"'zbv' needs pp >= 2 stages, got pp={pp}; use '1f1b'")
    if name not in (SCHEDULE_INTERLEAVED, SCHEDULE_ZBV) and v != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per stage but v={v}; "
                         "set v=1 or use the 'interleaved' schedule")
    if name == SCHEDULE_INTERLEAVED:
        if v < 2:
            raise ValueError(f"'interleaved' needs v >= 2 chunks per stage, got v={v}; "
                             "set v=2 or more, or use '1f1b'")
        if pp < 2:
            raise ValueError(f"'interleaved' needs pp >= 2 stages, got pp={pp}; "
                             "use '1f1b' or 'gpipe'")
        if m % pp:
            lower, upper = (m // pp) * pp, (m // pp + 1) * pp
            hint = f"{lower} or {upper}" if lower else f"{upper}"
            raise ValueError(f"'interleaved' needs the number of micro-batches to be a "
                             f"multiple of pp={pp}, got {m}; use {hint} micro-batches")
    if n_layer < pp * v:
        raise ValueError(f"pp x v = {pp}x{v} = {pp * v} chunks but the model has only "
                         f"n_layer={n_layer} blocks (each chunk needs one); lower pp or v, "
                         "or use a deeper model")


def build_schedule(name: str, *, pp: int, m: int, v: int = 1) -> Schedule:
    """Every pp rank's actions for ``m`` micro-batches (see the module docstring)."""
    validate_schedule(name, pp, m, v, n_layer=pp * v)
    if name in SPLIT_SCHEDULES:
        actions, _ = _zero_bubble(name, pp, m, v)
    else:
        make = {SCHEDULE_GPIPE: _gpipe, SCHEDULE_1F1B: _one_f_one_b,
                SCHEDULE_INTERLEAVED: _interleaved}[name]
        actions = tuple(tuple(make(pp, m, v, r)) for r in range(pp))
    return Schedule(name=name, pp=pp, m=m, v=v, actions=actions,
                    split=name in SPLIT_SCHEDULES, vshape=name in V_SCHEDULES)


def analytic_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a stage's step time with equal chunk costs and free messages
    (zero-bubble schedules: F = B = W, B + W the backward).

    GPipe and 1F1B: ``(pp-1) / (m + pp-1)``. Interleaved: the warmup/cooldown shrinks to
    ``(pp-1)/v`` full-stage slots against ``m`` busy ones, ``(pp-1) / (v m + pp-1)``
    (about the 1F1B value divided by v when m >> pp). ZB-H1: only the forwards' ramp
    stays idle, ``pp - 1`` forward slots against ``3m`` busy ones,
    ``(pp-1) / (3m + pp-1)`` (for m >= pp). ZBV: the idle fraction of its unit-cost
    run, ``(pp-1) / (6m + pp-1)`` (in chunk units) for m >= 2pp - 1.
    """
    if name == SCHEDULE_INTERLEAVED:
        return (pp - 1) / (v * m + pp - 1)
    if name in SPLIT_SCHEDULES:
        _, span = _zero_bubble(name, pp, m, 2 if name == SCHEDULE_ZBV else 1)
        busy = 3 * m * (2 if name == SCHEDULE_ZBV else 1)
        return (span - busy) / span
    return (pp - 1) / (m + pp - 1)


def _gpipe(pp: int, m: int, v: int, rank: int) -> list[Action]:
    return ([Action(FORWARD, rank, i) for i in range(m)]
            + [Action(BACKWARD, rank, i) for i in range(m)])


def _one_f_one_b(pp: int, m: int, v: int, rank: int) -> list[Action]:
    return _warmup_steady_cooldown(lambda j: Action(FORWARD, rank, j),
                                   lambda j: Action(BACKWARD, rank, j),
                                   total=m, warmup=min(pp - rank - 1, m))


def _interleaved(pp: int, m: int, v: int, rank: int) -> list[Action]:
    def position(j: int) -> tuple[int, int]:
        # The j-th forward (or backward) of this rank: micro-batches go in groups of pp
        # through local chunk 0, 1, ..., v-1 before the next group starts.
        group, offset = divmod(j, pp * v)
        return offset // pp, group * pp + offset % pp

    def forward(j: int) -> Action:
        local, micro = position(j)
        return Action(FORWARD, local * pp + rank, micro)

    def backward(j: int) -> Action:
        local, micro = position(j)
        return Action(BACKWARD, (v - 1 - local) * pp + rank, micro)

    # Enough forwards in flight that the first backward's gradient, coming back from
    # the last chunk, arrives without stalling this rank.
    warmup = min(m * v, 2 * (pp - rank - 1) + (v - 1) * pp)
    return _warmup_steady_cooldown(forward, backward, total=m * v, warmup=warmup)


def _warmup_steady_cooldown(forward: Callable[[int], Action],
                            backward: Callable[[int], Action], *, total: int,
                            warmup: int) -> list[Action]:
    out = [forward(j) for j in range(warmup)]
    for j in range(total - warmup):
        out += [forward(warmup + j), backward(j)]
    return out + [backward(j) for j in range(total - warmup, total)]


def zero_bubble_idle(name: str, pp: int, m: int) -> float:
    """Idle time of a zero-bubble schedule's rank over its busy time, with F = B = W:
    ``(span - busy) / busy`` of its unit-cost build. The idle units stop growing once
    ``m >= 2 pp`` (the ramp up and down is all there is), so the build runs on at most
    ``2 pp`` micro-batches and the planner can price any m."""
    v = 2 if name in V_SCHEDULES else 1
    small = min(m, 2 * pp)
    _, span = _zero_bubble(name, pp, small, v)
    return (span - 3 * v * small) / (3 * v * m)


@functools.lru_cache(maxsize=256)
def _zero_bubble(name: str, pp: int, m: int, v: int
                 ) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """Every rank's actions of a zero-bubble schedule, and the span of its unit-cost
    run with free messages (see the module docstring)."""
    greedy, span = _greedy_zero_bubble(name, pp, m, v)
    if name != SCHEDULE_ZBV:
        return greedy, span

    orders = (greedy, tuple(tuple(_v_order(pp, m, r)) for r in range(pp)))

    @functools.cache  # each order simulated once per message cost, only if compared
    def simulated(order: int, message: float) -> float:
        schedule = Schedule(name=name, pp=pp, m=m, v=v, actions=orders[order], split=True,
                            vshape=True)
        return max(t.end for rank in simulate(
            schedule, forward_time=1.0, backward_time=2.0, weight_time=1.0,
            message_time=message) for t in rank)

    # the shorter with message latency; on a tie the shorter without; then the greedy
    best = min((0, 1), key=lambda k: simulated(k, _V_MESSAGE_COST))
    if simulated(0, _V_MESSAGE_COST) == simulated(1, _V_MESSAGE_COST):
        best = min((0, 1), key=lambda k: simulated(k, 0.0))
    return orders[best], round(simulated(best, 0.0))


_V_MESSAGE_COST = 0.05  # of a chunk's forward (measured here: 1.9 ms against 50 ms)


def _v_order(pp: int, m: int, rank: int) -> list[Action]:
    """Rank ``rank``'s actions in the V of Qi et al. (2024) (the module docstring):
    built for ``max(m, 2pp - 1)`` micro-batches, the phases need that many, and the
    actions of micro-batches past ``m`` dropped (the others keep their order)."""
    down, up = rank, 2 * pp - 1 - rank  # first and second chunk of this rank
    total = max(m, 2 * pp - 1)
    steps = [(FORWARD, down)] * (2 * (pp - rank) - 1) + [(FORWARD, up), (FORWARD, down)] \
        * rank + [(FORWARD, up), (BACKWARD, up), (WEIGHT, up)] * (pp - rank)
    for j in range(total - pp):
        if j < total - (2 * pp - rank - 1):  # forwards of the first chunk left
            steps.append((FORWARD, down))
        steps += [(BACKWARD, down), (WEIGHT, down), (FORWARD, up), (BACKWARD, up),
                  (WEIGHT, up)]
    steps += [(BACKWARD, down), (BACKWARD, up)] * rank + [(BACKWARD, down), (WEIGHT, down)] \
        * (pp - rank) + [(WEIGHT, up)] * rank + [(WEIGHT, down)] * rank
    count: dict[tuple[str, int], int] = {}
    out = []
    for kind, chunk in steps:
        micro = count[kind, chunk] = count.get((kind, chunk), -1) + 1
        if micro < m:
            out.append(Action(kind, chunk, micro))
    return out


def _greedy_zero_bubble(name: str, pp: int, m: int, v: int,
                        held: tuple[int, ...] | None = None
                        ) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """The greedy unit-cost build of the module docstring, and its span. ``held[r]``:
    most forwards rank r runs ahead of its W's (default ``v pp``)."""
    vshape, n, never = name in V_SCHEDULES, pp * v, 1 << 60
    # forwards: the deepest chunk first (finish what is started); B and W: the oldest
    # micro-batch, then the deepest chunk
    mine = [sorted((c for c in range(n) if chunk_rank(c, pp, vshape) == r), reverse=True)
            for r in range(pp)]
    ends = {FORWARD: [[never] * m for _ in range(n)],
            BACKWARD: [[never] * m for _ in range(n)]}  # end time of each F / B run
    nxt = {kind: [0] * n for kind in (FORWARD, BACKWARD, WEIGHT)}
    ahead_of_b, ahead_of_w = [0] * pp, [0] * pp  # forwards not yet through B / W
    out: list[list[Action]] = [[] for _ in range(pp)]
    order = (FORWARD, BACKWARD, WEIGHT) if name == SCHEDULE_ZB1 else (
        BACKWARD, FORWARD, WEIGHT)
    fb_limit = [pp - r if name == SCHEDULE_ZB1 else v * pp for r in range(pp)]
    t, left = 0, 3 * n * m

    def ready(kind: str, c: int, i: int) -> bool:
        if kind == FORWARD:
            return c == 0 or ends[FORWARD][c - 1][i] <= t
        if kind == BACKWARD:
            return ends[FORWARD][c][i] <= t and (c == n - 1 or ends[BACKWARD][c + 1][i] <= t)
        return ends[BACKWARD][c][i] <= t

    while left:
        for r in range(pp):
            may_forward = ahead_of_b[r] < fb_limit[r] and ahead_of_w[r] < (
                held[r] if held else v * pp)
            best: tuple[int, int, int] | None = None  # (micro, -chunk, chunk) for B / W
            for kind in order:
                if kind == FORWARD and not may_forward:
                    continue
                for c in mine[r]:
                    i = nxt[kind][c]
                    if i < m and ready(kind, c, i):
                        key = (0, 0, c) if kind == FORWARD else (i, -c, c)
                        best = key if best is None or key < best else best
                        if kind == FORWARD:
                            break  # the deepest ready forward
                if best is not None:
                    break
            if best is None:
                continue
            c, i = best[2], nxt[kind][best[2]]
            out[r].append(Action(kind, c, i))
            if kind != WEIGHT:
                ends[kind][c][i] = t + 1
            nxt[kind][c] += 1
            left -= 1
            ahead_of_b[r] += {FORWARD: 1, BACKWARD: -1}.get(kind, 0)
            ahead_of_w[r] += {FORWARD: 1, WEIGHT: -1}.get(kind, 0)
        t += 1
        if t > 3 * n * m + 4 * n:  # never: some rank can always make progress
            raise RuntimeError(f"{name} pp={pp} m={m}: the greedy build is stuck")
    return tuple(map(tuple, out)), t
