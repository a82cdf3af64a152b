"""Check and simulate a :class:`Schedule` without processes (pure Python).

The simulation follows the runner's semantics: sends never block (they are posted
asynchronously), a rank blocks on an action until the message it needs has been sent,
and runs its actions strictly in order. If some rank waits for a message that is never
sent, :func:`simulate` raises :class:`ScheduleDeadlock` naming what each stuck rank
waits for; otherwise it returns each action's start and end time for given costs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule


class ScheduleDeadlock(RuntimeError):
    """Some rank waits for a message that no rank will ever send."""


@dataclass(frozen=True)
class TimedAction:
    action: Action
    rank: int
    start: float
    end: float


def check_schedule(schedule: Schedule) -> None:
    """Raise ValueError unless every rank runs the forward and the backward (split:
    B and W) of each of its chunks on each micro-batch exactly once, each backward
    after its forward, each W after its B."""
    kinds = (FORWARD, BACKWARD, WEIGHT) if schedule.split else (FORWARD, BACKWARD)
    for rank, actions in enumerate(schedule.actions):
        want = Counter(Action(kind, c, i) for kind in kinds
                       for c in range(schedule.n_chunks) if schedule.rank_of(c) == rank
                       for i in range(schedule.m))
        if Counter(actions) != want:
            missing = sorted(map(str, want - Counter(actions)))
            extra = sorted(map(str, Counter(actions) - want))
            raise ValueError(f"rank {rank}: missing {missing}, unexpected {extra}")
        seen: set[Action] = set()
        for a in actions:
            before = {BACKWARD: FORWARD, WEIGHT: BACKWARD}.get(a.kind)
            if before and Action(before, a.chunk, a.micro) not in seen:
                raise ValueError(f"rank {rank}: {a} runs before its "
                                 f"{'forward' if before == FORWARD else 'B'}")
            seen.add(a)


def dependencies(action: Action, n_chunks: int) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes (messages or local activations)."""
    return tuple(Action(kind, c, action.micro)
                 for kind, c in _needs(action.kind, action.chunk, n_chunks))


def _needs(kind: str, c: int, n_chunks: int) -> tuple[tuple[str, int], ...]:
    """(kind, chunk) of the actions on the same micro-batch that an action of ``kind``
    on chunk ``c`` consumes: the previous chunk's forward; its own B; its own forward
    and the next chunk's backward."""
    if kind == FORWARD:
        return ((FORWARD, c - 1),) if c > 0 else ()
    if kind == WEIGHT:
        return ((BACKWARD, c),)
    return ((FORWARD, c), (BACKWARD, c + 1)) if c < n_chunks - 1 else ((FORWARD, c),)


def simulate(schedule: Schedule, *, forward_time: float | Sequence[float] = 1.0,
             backward_time: float | Sequence[float] = 2.0,
             message_time: float = 0.0,
             weight_time: float | Sequence[float] | None = None) -> list[list[TimedAction]]:
    """Each rank's actions with start/end times. Costs are per chunk action: one value
    for every chunk, or one per global chunk (stages of unequal cost).
    ``backward_time`` is the whole backward; a split schedule's W takes
    ``weight_time`` of it (default half) and its B the rest."""
    n = schedule.n_chunks
    backward = _per_chunk(backward_time, n, "backward_time")
    weight = _per_chunk(weight_time if weight_time is not None else
                        tuple(b / 2 for b in backward), n, "weight_time")
    if schedule.split:
        backward = tuple(b - w for b, w in zip(backward, weight, strict=True))
    costs = {FORWARD: _per_chunk(forward_time, n, "forward_time"),
             BACKWARD: backward, WEIGHT: weight}
    done: dict[tuple[str, int, int], float] = {}  # end of each (kind, chunk, micro) run
    needs = {(kind, c): _needs(kind, c, n) for kind in costs for c in range(n)}
    rank_of = [schedule.rank_of(c) for c in range(n)]
    pos, free = [0] * schedule.pp, [0.0] * schedule.pp
    out: list[list[TimedAction]] = [[] for _ in range(schedule.pp)]
    remaining = sum(map(len, schedule.actions))
    while remaining:
        moved = 0
        for rank, actions in enumerate(schedule.actions):
            while pos[rank] < len(actions):
                action = actions[pos[rank]]
                start, ready = free[rank], True
                for kind, c in needs[action.kind, action.chunk]:
                    end = done.get((kind, c, action.micro))
                    if end is None:
                        ready = False
                        break
                    start = max(start, end + message_time if rank_of[c] != rank else end)
                if not ready:
                    break
                cost = costs[action.kind][action.chunk]
                done[action.kind, action.chunk, action.micro] = free[rank] = start + cost
                out[rank].append(TimedAction(action, rank, start, start + cost))
                pos[rank] += 1
                moved += 1
        if not moved:
            raise ScheduleDeadlock(_stuck(schedule, pos, done))
        remaining -= moved
    return out


def _per_chunk(cost: float | Sequence[float], n_chunks: int, name: str) -> tuple[float, ...]:
    if isinstance(cost, (int, float)):
        return (cost,) * n_chunks
    if len(cost) != n_chunks:
        raise ValueError(f"{name} has {len(cost)} costs but the schedule has {n_chunks} "
                         "chunks; give one per global chunk, or a single number")
    return tuple(cost)


def bubble_fractions(timeline: list[list[TimedAction]]) -> list[float]:
    """Per rank: 1 - busy / span, the span being the whole step (first start to last
    end over all ranks)."""
    starts = [t.start for actions in timeline for t in actions]
    ends = [t.end for actions in timeline for t in actions]
    span = max(ends) - min(starts)
    return [1 - sum(t.end - t.start for t in actions) / span for actions in timeline]


def _stuck(schedule: Schedule, pos: list[int], done: dict[tuple[str, int, int], float]
           ) -> str:
    lines = []
    for rank, actions in enumerate(schedule.actions):
        if pos[rank] < len(actions):
            action = actions[pos[rank]]
            waits = [str(d) for d in dependencies(action, schedule.n_chunks)
                     if (d.kind, d.chunk, d.micro) not in done]
            lines.append(f"rank {rank} at {action} waits for {', '.join(waits)}")
    return f"{schedule.name} pp={schedule.pp} m={schedule.m} v={schedule.v} deadlocks: " \
        + "; ".join(lines)
