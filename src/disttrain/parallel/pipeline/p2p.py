"""Which point-to-point messages a pp rank posts and when, and a check that NCCL can
complete them (pure Python, no process group).

Under NCCL, torch puts the messages between two ranks on one stream per pair (both
directions), run in the order each side posted them, and a send completes only when
the peer's receive runs (rendezvous). The two sides must therefore post the messages
of a pair in one consistent order, or both can stall at a send (or a receive) the
other has queued behind something else; tags do not help, NCCL ignores them.

Every rank derives that order from the same :class:`Schedule`: the messages of a pair,
sorted by when they are produced in the schedule's unit-cost timeline (forward 1,
backward 2; ties by sender rank and tag). Before each action a rank posts, pair by
pair and in that order, every receive it can (receives need nothing) and every send
whose data it has produced; it stops at a send whose data its next actions still have
to compute. So a send goes out as soon as its action ran, and a receive is posted well
before the action that needs it.

:func:`check_nccl_order` runs every rank's posted messages the way NCCL does (per-pair
streams, rendezvous, a send waits for its action, an action waits for its receive, the
CPU never blocks) and raises :class:`~.simulate.ScheduleDeadlock` naming what each
stuck rank waits for; it also checks that the n-th message each way of a pair is the
same on both sides (a mismatch there is a wrong message, whatever its tag).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from .schedules import FORWARD, WEIGHT, Action, Schedule
from .simulate import ScheduleDeadlock, simulate


@dataclass(frozen=True)
class Message:
    """One activation [b, T, d] or its gradient, seen from the rank posting it:
    ``send`` or receive, with pp rank ``peer``; ``action`` produced it."""

    send: bool
    peer: int
    tag: int
    action: Action

    def __str__(self) -> str:
        verb = "send to" if self.send else "receive from"
        return f"{verb} pp rank {self.peer} the output of {self.action} (tag {self.tag})"


def message_tag(schedule: Schedule, boundary: int, backward: bool, micro: int) -> int:
    """The tag of the message crossing the cut after chunk ``boundary``."""
    return (2 * boundary + int(backward)) * schedule.m + micro


def destination(schedule: Schedule, action: Action) -> tuple[int, int] | None:
    """(pp rank, tag) that ``action``'s output goes to, or None (the last chunk's
    forward, the first chunk's backward, a weight-gradient pass, and an output the
    next chunk takes on the same rank: the turn of a V)."""
    c, i = action.chunk, action.micro
    if action.kind == WEIGHT:
        return None
    if action.kind == FORWARD:
        if c == schedule.n_chunks - 1:
            return None
        return _remote(schedule, c, c + 1, message_tag(schedule, c, False, i))
    if c == 0:
        return None
    return _remote(schedule, c, c - 1, message_tag(schedule, c - 1, True, i))


def source(schedule: Schedule, action: Action) -> tuple[int, int] | None:
    """(pp rank, tag) of the message ``action`` consumes, or None (the first chunk's
    forward, the last chunk's backward, a weight-gradient pass, and an input the
    previous chunk hands over on the same rank)."""
    c, i = action.chunk, action.micro
    if action.kind == WEIGHT:
        return None
    if action.kind == FORWARD:
        if c == 0:
            return None
        return _remote(schedule, c, c - 1, message_tag(schedule, c - 1, False, i))
    if c == schedule.n_chunks - 1:
        return None
    return _remote(schedule, c, c + 1, message_tag(schedule, c, True, i))


def _remote(schedule: Schedule, chunk: int, peer_chunk: int, tag: int
            ) -> tuple[int, int] | None:
    peer = schedule.rank_of(peer_chunk)
    return None if peer == schedule.rank_of(chunk) else (peer, tag)


@functools.lru_cache(maxsize=64)
def pair_order(schedule: Schedule) -> dict[frozenset, tuple[tuple[int, int, Action], ...]]:
    """Per pair of pp ranks: its messages (sender, tag, producing action) in the one
    order both sides post them."""
    produced = {t.action: (t.end, t.rank) for rank in simulate(schedule) for t in rank}
    pairs: dict[frozenset, list] = {}
    for sender, actions in enumerate(schedule.actions):
        for a in actions:
            dest = destination(schedule, a)
            if dest is not None:
                end, _ = produced[a]
                pairs.setdefault(frozenset((sender, dest[0])), []).append(
                    (end, sender, dest[1], a))
    return {pair: tuple((s, tag, a) for _, s, tag, a in sorted(items, key=lambda x: x[:3]))
            for pair, items in pairs.items()}


@functools.lru_cache(maxsize=64)
def message_groups(schedule: Schedule, rank: int) -> tuple[tuple[Message, ...], ...]:
    """pp rank ``rank``'s posts: ``groups[k]`` goes out before its k-th action and
    ``groups[len(actions)]`` after its last one (see the module docstring)."""
    mine = {next(iter(pair - {rank}), rank): order
            for pair, order in pair_order(schedule).items() if rank in pair}
    at = dict.fromkeys(mine, 0)
    actions = schedule.actions[rank]
    done: set[Action] = set()
    posted: set[tuple[int, int]] = set()  # (peer, tag) of receives posted
    groups = []
    for k in range(len(actions) + 1):
        if k:
            done.add(actions[k - 1])
        group = []
        for peer in sorted(mine):
            order = mine[peer]
            while at[peer] < len(order):
                sender, tag, action = order[at[peer]]
                if sender == rank and action not in done:
                    break
                group.append(Message(sender == rank, peer, tag, action))
                if sender != rank:
                    posted.add((peer, tag))
                at[peer] += 1
        if k < len(actions):
            need = source(schedule, actions[k])
            if need is not None and need not in posted:
                raise ScheduleDeadlock(f"{_name(schedule)}: pp rank {rank} cannot post "
                                       f"the receive {actions[k]} needs in the pair order")
        groups.append(tuple(group))
    return tuple(groups)


@functools.lru_cache(maxsize=64)
def check_nccl_order(schedule: Schedule) -> None:
    """Raise :class:`ScheduleDeadlock` unless every rank's posted messages complete
    under NCCL's matching (see the module docstring)."""
    check_posts(schedule, [message_groups(schedule, r) for r in range(schedule.pp)])


def check_posts(schedule: Schedule,
                posts: Sequence[Sequence[Sequence[Message]]]) -> None:
    """:func:`check_nccl_order` for any posting plan: ``posts[r][k]`` are the messages
    pp rank r posts before its k-th action (``k = len(actions)``: after the last)."""
    pp = schedule.pp
    index = [{a: k for k, a in enumerate(schedule.actions[r])} for r in range(pp)]
    # streams[r][peer]: (message, the action index its send waits for) in posting order
    streams: list[dict[int, list[tuple[Message, int]]]] = [{} for _ in range(pp)]
    for r in range(pp):
        for k, group in enumerate(posts[r]):
            for m in group:
                streams[r].setdefault(m.peer, []).append((m, k))
    for r in range(pp):
        for peer, stream in streams[r].items():
            sent = [m for m, _ in stream if m.send]
            got = [m for m, _ in streams[peer].get(r, []) if not m.send]
            for n, (a, b) in enumerate(zip(sent, got, strict=False)):
                if a.tag != b.tag:
                    raise ScheduleDeadlock(
                        f"{_name(schedule)}: message {n} from pp rank {r} to {peer} is "
                        f"tag {a.tag} but rank {peer} receives tag {b.tag} there; NCCL "
                        "matches the messages of a pair in posting order")
            if len(sent) != len(got):
                raise ScheduleDeadlock(f"{_name(schedule)}: pp rank {r} sends {len(sent)} "
                                       f"messages to {peer}, which receives {len(got)}")
    head = [dict.fromkeys(streams[r], 0) for r in range(pp)]
    ran = [0] * pp  # actions each rank has run
    arrived: set[tuple[int, int, int]] = set()  # (receiver, peer, tag)

    def ready(r: int, peer: int) -> Message | None:
        stream = streams[r][peer]
        if head[r][peer] == len(stream):
            return None
        m, k = stream[head[r][peer]]
        return None if m.send and index[r][m.action] >= ran[r] else m

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            for peer in streams[r]:
                mine, their = ready(r, peer), ready(peer, r)
                if (mine is not None and mine.send and their is not None
                        and not their.send and their.tag == mine.tag):
                    arrived.add((peer, r, mine.tag))
                    head[r][peer] += 1
                    head[peer][r] += 1
                    progress = True
            while ran[r] < len(schedule.actions[r]):
                need = source(schedule, schedule.actions[r][ran[r]])
                if need is not None and (r, *need) not in arrived:
                    break
                ran[r] += 1
                progress = True
    lines = []
    for r in range(pp):
        waiting = [str(streams[r][p][head[r][p]][0]) for p in streams[r]
                   if head[r][p] < len(streams[r][p])]
        if ran[r] < len(schedule.actions[r]) or waiting:
            at = (f"at {schedule.actions[r][ran[r]]}" if ran[r] < len(schedule.actions[r])
                  else "after its last action")
            lines.append(f"rank {r} {at} waits to {'; '.join(waiting)}")
    if lines:
        raise ScheduleDeadlock(f"{_name(schedule)} hangs under NCCL's p2p matching: "
                               + " | ".join(lines))


def _name(schedule: Schedule) -> str:
    return f"{schedule.name} pp={schedule.pp} m={schedule.m} v={schedule.v}"
