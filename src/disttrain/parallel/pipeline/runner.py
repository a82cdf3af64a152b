"""Running one pp rank's part of a pipeline schedule.

:func:`run_pipeline` executes this rank's actions in order. Activations [B, T, d] go
forward and their gradients backward through the pp group's :class:`Communicator` as
``isend``/``irecv`` pairs matched by a tag unique to (boundary, direction,
micro-batch), so messages between two ranks never cross whatever order they are
posted in. Sends never block (they are waited for at the end), and the receive needed
by the next action is posted before the current one computes, so a rank blocks only
when its input really is missing; a schedule that passes
:func:`~.simulate.simulate` therefore cannot deadlock here.

The last chunk computes ``loss_fn(logits, targets) -> (loss_sum, count)`` and
backpropagates ``loss_sum * loss_scale``. Gradients accumulate in the chunks'
parameters (``.grad``); the tied embedding/head weight still needs
:func:`~.stages.sync_tied_grads`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from ...comm.collectives import Communicator, TrackedWork
from .memory import SavedActivationMeter
from .schedules import FORWARD, Action, Schedule
from .stages import PipelineChunk

LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]
GradSync = Callable[[int, bool], AbstractContextManager]
_MAX_TAG = 1 << 24  # tags at and above belong to sync_tied_grads


@dataclass(frozen=True)
class ActionTiming:
    """Clock readings (seconds) around one action: ``start`` once its input is there,
    ``end`` when its output has been handed to the send; ``wait`` = time blocked on the
    receive before ``start``."""

    action: Action
    start: float
    end: float
    wait: float


@dataclass
class PipelineStepResult:
    """This rank's share of one step.

    ``loss_sum``: summed (unscaled) loss of its micro-batches, 0-dim, zero unless it
    holds the last chunk; ``count``: their loss terms; ``timings``: one per action in
    schedule order; ``peak_activation_bytes``: most bytes saved for backward held at
    once (parameters excluded).
    """

    loss_sum: torch.Tensor
    count: int
    timings: list[ActionTiming] = field(default_factory=list)
    peak_activation_bytes: int = 0


def run_pipeline(chunks: Sequence[PipelineChunk],
                 micro_batches: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
                 loss_fn: LossFn, comm: Communicator, schedule: Schedule, *,
                 activation_shape: Sequence[int],
                 activation_dtype: torch.dtype = torch.float32, loss_scale: float = 1.0,
                 grad_sync: GradSync | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> PipelineStepResult:
    """Run pp rank ``comm.rank``'s actions of ``schedule`` over ``chunks`` (the chunks
    :func:`~.stages.build_chunks` gave this rank).

    ``micro_batches[i]`` = (inputs, targets): every chunk gets the inputs (input_ids
    [b, T], or an object with ``args`` / ``kwargs``; chunks after the first use them
    only for what the model derives from them, e.g. attention masks), the last chunk's
    ``loss_fn`` the targets. ``activation_shape`` is
    [b, T, d], the shape of every message. ``grad_sync(chunk, last)`` returns the
    context each backward runs in; ``last`` is True for the chunk's final backward of
    the step (data parallelism runs the others under ``no_sync()``).
    """
    if len(micro_batches) != schedule.m:
        raise ValueError(f"the schedule runs m={schedule.m} micro-batches but "
                         f"{len(micro_batches)} were given; build it with the same m")
    if 2 * schedule.n_chunks * schedule.m > _MAX_TAG:
        raise ValueError(f"{schedule.n_chunks} chunks x {schedule.m} micro-batches exceed "
                         "the message tag space; use fewer micro-batches per step")
    want = schedule.actions[comm.rank]
    held = sorted(ch.index for ch in chunks)
    if held != sorted({a.chunk for a in want}):
        raise ValueError(f"pp rank {comm.rank} holds chunks {held} but the schedule runs "
                         f"{sorted({a.chunk for a in want})} there; build the chunks for "
                         "this rank from a plan with the schedule's pp and v")
    runner = _Runner(chunks, micro_batches, loss_fn, comm, schedule,
                     tuple(activation_shape), activation_dtype, loss_scale,
                     grad_sync, clock)
    return runner.run(want)


def _incoming(schedule: Schedule, rank: int, tag: Callable[[int, bool, int], int]
              ) -> dict[int, list[int]]:
    """For each pp rank that sends to ``rank``: the tags of its messages to ``rank``, in
    the order it posts them (its actions' order; every rank knows the schedule)."""
    channels: dict[int, list[int]] = {}
    last = schedule.n_chunks - 1
    for peer, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind == FORWARD and a.chunk < last:
                dst, t = schedule.rank_of(a.chunk + 1), tag(a.chunk, False, a.micro)
            elif a.kind != FORWARD and a.chunk > 0:
                dst, t = schedule.rank_of(a.chunk - 1), tag(a.chunk - 1, True, a.micro)
            else:
                continue
            if dst == rank:
                channels.setdefault(peer, []).append(t)
    return channels


class _Runner:
    def __init__(self, chunks: Sequence[PipelineChunk], micro_batches: Sequence,
                 loss_fn: LossFn, comm: Communicator, schedule: Schedule,
                 shape: tuple[int, ...], dtype: torch.dtype, loss_scale: float,
                 grad_sync: GradSync | None, clock: Callable[[], float]) -> None:
        self.chunks = {ch.index: ch for ch in chunks}
        self.micro_batches, self.loss_fn, self.comm = micro_batches, loss_fn, comm
        self.schedule, self.shape, self.dtype = schedule, shape, dtype
        self.loss_scale, self.clock = loss_scale, clock
        self.grad_sync = grad_sync or (lambda chunk, last: contextlib.nullcontext())
        self.meter = SavedActivationMeter(p for ch in chunks for p in ch.parameters())
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.recvs: dict[tuple[int, int], tuple[torch.Tensor, TrackedWork]] = {}
        # per peer: the tags of the messages it sends this rank, in its posting order
        self.channels = _incoming(schedule, comm.rank, self._tag)
        self.posted = dict.fromkeys(self.channels, 0)
        self.sends: list[tuple[torch.Tensor, TrackedWork]] = []
        self.loss_sum = torch.zeros(())
        self.count = 0

    def run(self, actions: Sequence[Action]) -> PipelineStepResult:
        last_backward = {a.chunk: k for k, a in enumerate(actions) if a.kind != FORWARD}
        timings = []
        for k, action in enumerate(actions):
            self._post_recv(action)
            if k + 1 < len(actions):
                self._post_recv(actions[k + 1])
            t0 = self.clock()
            if action.kind == FORWARD:
                x = self._forward_input(action)
                start = self.clock()
                self._forward(action, x)
            else:
                grad = self._backward_grad(action)
                start = self.clock()
                self._backward(action, grad, last=last_backward[action.chunk] == k)
            timings.append(ActionTiming(action, start, self.clock(), start - t0))
            self.sends = [(t, w) for t, w in self.sends if not w.is_completed()]
        for _, work in self.sends:
            work.wait()
        return PipelineStepResult(self.loss_sum, self.count, timings,
                                  self.meter.peak_bytes)

    # messages -------------------------------------------------------------------

    def _tag(self, boundary: int, backward: bool, micro: int) -> int:
        return (2 * boundary + int(backward)) * self.schedule.m + micro

    def _source(self, action: Action) -> tuple[int, int] | None:
        """(peer, tag) of the message ``action`` needs, or None (first chunk's forward,
        last chunk's backward)."""
        c, i = action.chunk, action.micro
        if action.kind == FORWARD:
            return None if c == 0 else (self.schedule.rank_of(c - 1),
                                        self._tag(c - 1, False, i))
        if c == self.schedule.n_chunks - 1:
            return None
        return self.schedule.rank_of(c + 1), self._tag(c, True, i)

    def _post_recv(self, action: Action) -> None:
        """Start receiving ``action``'s input (activation or output gradient), and
        before it every message its sender posts to this rank earlier: receives are
        posted in the order the peer sends, so they match in posting order (NCCL's
        rule), whatever the tags."""
        source = self._source(action)
        if source is None or source in self.recvs:
            return
        peer, tag = source
        order = self.channels[peer]
        while True:
            next_tag = order[self.posted[peer]]
            self.posted[peer] += 1
            buf = self.comm.empty(*self.shape, dtype=self.dtype)
            self.recvs[peer, next_tag] = (buf, self.comm.irecv(buf, peer, next_tag))
            if next_tag == tag:
                return

    def _take_recv(self, action: Action) -> torch.Tensor:
        self._post_recv(action)
        buf, work = self.recvs.pop(self._source(action))
        work.wait()
        return buf

    def _send(self, tensor: torch.Tensor, action: Action) -> None:
        c, i = action.chunk, action.micro
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(f"chunk {c} produced {tuple(tensor.shape)} {tensor.dtype} but "
                             f"messages are {self.shape} {self.dtype}; pass the real "
                             "activation_shape / activation_dtype to run_pipeline")
        forward = action.kind == FORWARD
        peer = self.schedule.rank_of(c + 1 if forward else c - 1)
        tag = self._tag(c, False, i) if forward else self._tag(c - 1, True, i)
        tensor = tensor.detach().contiguous()
        self.sends.append((tensor, self.comm.isend(tensor, peer, tag)))

    # compute --------------------------------------------------------------------

    def _forward_input(self, action: Action) -> torch.Tensor | None:
        if action.chunk == 0:
            return None
        return self._take_recv(action).requires_grad_()

    def _forward(self, action: Action, x: torch.Tensor | None) -> None:
        chunk, key = self.chunks[action.chunk], (action.chunk, action.micro)
        self.inputs[key] = x
        with self.meter.counting():
            y = chunk(x, self.micro_batches[action.micro][0])
            if chunk.is_last:
                loss, count = self.loss_fn(y, self.micro_batches[action.micro][1])
                self.loss_sum = self.loss_sum + loss.detach().float()
                self.count += int(count)
                y = loss * self.loss_scale if self.loss_scale != 1.0 else loss
        self.outputs[key] = y
        if not chunk.is_last:
            self._send(y, action)

    def _backward_grad(self, action: Action) -> torch.Tensor | None:
        if self.chunks[action.chunk].is_last:
            return None
        return self._take_recv(action)

    def _backward(self, action: Action, grad: torch.Tensor | None, *, last: bool) -> None:
        key = (action.chunk, action.micro)
        out, x = self.outputs.pop(key), self.inputs.pop(key)
        with self.grad_sync(action.chunk, last):
            torch.autograd.backward(out, grad_tensors=grad)
        if action.chunk > 0:
            self._send(x.grad if x.grad is not None else torch.zeros_like(x), action)
