"""Pipeline schedules as data: each pp rank's ordered list of forward/backward actions.

Pure Python (no torch, no process groups), so the config validator can check a
schedule before any group exists and the planner can simulate one.

The model is cut into ``n = pp * v`` chunks; chunk ``c`` lives on pp rank ``c % pp``
(rank ``r`` holds chunks ``r, r + pp, ..., r + (v-1) pp``). An action is
``Action(kind, chunk, micro)``. Sends and receives are implied:

- ``F(c, i)`` receives micro-batch ``i``'s activation from chunk ``c - 1`` (unless
  ``c == 0``) and sends its output to chunk ``c + 1`` (unless ``c == n - 1``);
- ``B(c, i)`` receives the gradient of its output from chunk ``c + 1`` (unless last)
  and sends the gradient of its input to chunk ``c - 1`` (unless first).

Schedules:

- ``gpipe``: all forwards, then all backwards (m activations alive per stage);
- ``1f1b``: ``pp - r - 1`` warmup forwards, then one forward / one backward, then the
  remaining backwards (at most ``pp - r`` activations alive on rank r);
- ``interleaved``: 1F1B over ``v`` chunks per rank (the idea of Narayanan et al.,
  2021): forwards go through the rank's chunks in groups of ``pp`` micro-batches, so
  the warmup and cooldown are made of chunk-sized (1/v) pieces and the bubble shrinks
  by about ``v``. Needs ``m`` to be a multiple of ``pp``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...names import SCHEDULE_1F1B, SCHEDULE_GPIPE, SCHEDULE_INTERLEAVED, SCHEDULES

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    """One forward or backward of one chunk on one micro-batch."""

    kind: str  # FORWARD or BACKWARD
    chunk: int  # global chunk index, 0 .. pp*v - 1
    micro: int  # micro-batch index, 0 .. m - 1

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.micro}"


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """``actions[r]``: pp rank r's actions, in the order it runs them."""

    name: str
    pp: int
    m: int
    v: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def n_chunks(self) -> int:
        return self.pp * self.v

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp


def validate_schedule(name: str, pp: int, m: int, v: int, n_layer: int) -> None:
    """Raise ValueError (what is wrong, the value, the fix) if the schedule ``name``
    cannot run ``m`` micro-batches on ``pp`` stages with ``v`` chunks per stage of a
    model with ``n_layer`` blocks."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is unknown; use one of {SCHEDULES}")
    for field, value in (("pp", pp), ("micro-batches", m), ("v", v)):
        if value < 1:
            raise ValueError(f"pipeline {field}={value} must be at least 1")
    if name != SCHEDULE_INTERLEAVED and v != 1:
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
    make = {SCHEDULE_GPIPE: _gpipe, SCHEDULE_1F1B: _one_f_one_b,
            SCHEDULE_INTERLEAVED: _interleaved}[name]
    actions = tuple(tuple(make(pp, m, v, r)) for r in range(pp))
    return Schedule(name=name, pp=pp, m=m, v=v, actions=actions)


def analytic_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a stage's step time with equal chunk costs and free messages.

    GPipe and 1F1B: ``(pp-1) / (m + pp-1)``. Interleaved: the warmup/cooldown shrinks to
    ``(pp-1)/v`` full-stage slots against ``m`` busy ones, ``(pp-1) / (v m + pp-1)``
    (about the 1F1B value divided by v when m >> pp).
    """
    if name == SCHEDULE_INTERLEAVED:
        return (pp - 1) / (v * m + pp - 1)
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
