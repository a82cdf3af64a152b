"""Running one pp rank's part of a pipeline schedule.

:func:`run_pipeline` executes this rank's actions in order. Activations [B, T, d] go
forward and their gradients backward through the pp group's :class:`Communicator` as
``isend``/``irecv`` pairs. Which messages go out before each action comes from
:func:`~.p2p.message_groups`: both sides of every pair of ranks post that pair's
messages in one order derived from the schedule, which is what NCCL needs (it matches
by posting order and a send waits for its receive); :func:`~.p2p.check_nccl_order`
proves a schedule cannot hang that way and runs before the first step of each
schedule. Sends go out as soon as their action ran and are waited for at the end;
receives are posted ahead, so a rank blocks only when its input really is missing.

The last chunk computes ``loss_fn(logits, targets) -> (loss_sum, count)`` and
backpropagates ``loss_sum * loss_scale``. Gradients accumulate in the chunks'
parameters (``.grad``); the tied embedding/head weight still needs
:func:`~.stages.sync_tied_grads`. A split schedule's B computes only the gradient of
the chunk's input and its W the weight gradients (:mod:`.split_backward`); the
parameters' gradients (and the data-parallel hooks they fire) all come from W, which
runs inside ``grad_sync``, so every W is over when :func:`run_pipeline` returns (and
before any gradient norm). Where consecutive chunks share a rank (the turn of a V),
the activation and its gradient are handed over without a message.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from ...comm.collectives import Communicator, TrackedWork
from ...monitor.saved_activations import SavedActivationMeter
from .chunks import PipelineChunk
from .p2p import check_nccl_order, destination, message_groups, source
from .schedules import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from .split_backward import (
    DeferredWeightGrads,
    WeightPassSaves,
    backward_input,
    backward_weight,
)

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
    holds the last chunk; ``count``: their loss terms (a tensor where the loss gave one:
    never read on the host here); ``timings``: one per action in
    schedule order; ``peak_activation_bytes``: most bytes saved for backward held at
    once (parameters excluded), None unless the run measured them.
    """

    loss_sum: torch.Tensor
    count: torch.Tensor | int
    timings: list[ActionTiming] = field(default_factory=list)
    peak_activation_bytes: int | None = None


def run_pipeline(chunks: Sequence[PipelineChunk],
                 micro_batches: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
                 loss_fn: LossFn, comm: Communicator, schedule: Schedule, *,
                 activation_shape: Sequence[int],
                 activation_dtype: torch.dtype = torch.float32,
                 loss_scale: torch.Tensor | float | None = None,
                 grad_sync: GradSync | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 measure_activations: bool = False) -> PipelineStepResult:
    """Run pp rank ``comm.rank``'s actions of ``schedule`` over ``chunks`` (the chunks
    :func:`~.stages.build_chunks` gave this rank).

    ``micro_batches[i]`` = (inputs, targets): every chunk gets the inputs (input_ids
    [b, T], or an object with ``args`` / ``kwargs``; chunks after the first use them
    only for what the model derives from them, e.g. attention masks), the last chunk's
    ``loss_fn`` the targets. ``activation_shape`` is
    [b, T, d], the shape of every message. ``grad_sync(chunk, last)`` returns the
    context each backward runs in; ``last`` is True for the chunk's final backward of
    the step (data parallelism runs the others under ``no_sync()``); in a split
    schedule it wraps the W passes (where the weight gradients accumulate).
    ``measure_activations``: count the bytes saved for backward
    (``peak_activation_bytes``); a hook on every saved tensor, so only when asked.
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
                     grad_sync, clock, measure_activations)
    return runner.run(want)


class _Runner:
    def __init__(self, chunks: Sequence[PipelineChunk], micro_batches: Sequence,
                 loss_fn: LossFn, comm: Communicator, schedule: Schedule,
                 shape: tuple[int, ...], dtype: torch.dtype,
                 loss_scale: torch.Tensor | float | None,
                 grad_sync: GradSync | None, clock: Callable[[], float],
                 measure_activations: bool) -> None:
        self.chunks = {ch.index: ch for ch in chunks}
        self.micro_batches, self.loss_fn, self.comm = micro_batches, loss_fn, comm
        self.schedule, self.shape, self.dtype = schedule, shape, dtype
        self.loss_scale, self.clock = loss_scale, clock
        self.grad_sync = grad_sync or (lambda chunk, last: contextlib.nullcontext())
        self.meter = (SavedActivationMeter(p for ch in chunks for p in ch.parameters())
                      if measure_activations else None)
        # split: B releases the saved tensors no W reads (through the meter's count)
        self.saves = WeightPassSaves(self.meter) if schedule.split else None
        self.inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.recvs: dict[tuple[int, int], tuple[torch.Tensor, TrackedWork]] = {}
        check_nccl_order(schedule)
        self.groups = message_groups(schedule, comm.rank)
        self.produced: dict[Action, torch.Tensor] = {}  # outputs waiting for their send
        self.local: dict[Action, torch.Tensor] = {}  # outputs the next chunk takes here
        self.deferred: dict[tuple[int, int], DeferredWeightGrads] = {}  # B's, for W
        self.sends: list[tuple[torch.Tensor, TrackedWork]] = []
        self.loss_sum = torch.zeros((), device=comm.device)
        self.count: torch.Tensor | int = 0

    def run(self, actions: Sequence[Action]) -> PipelineStepResult:
        grads_from = WEIGHT if self.schedule.split else BACKWARD
        last_backward = {a.chunk: k for k, a in enumerate(actions) if a.kind == grads_from}
        timings = []
        for k, action in enumerate(actions):
            self._post(self.groups[k])
            t0 = self.clock()
            if action.kind == FORWARD:
                x = self._forward_input(action)
                start = self.clock()
                self._forward(action, x)
            elif action.kind == WEIGHT:
                start = t0
                with self.grad_sync(action.chunk, last_backward[action.chunk] == k):
                    backward_weight(self.deferred.pop((action.chunk, action.micro)))
            else:
                grad = self._backward_grad(action)
                start = self.clock()
                self._backward(action, grad, last=last_backward.get(action.chunk) == k)
            timings.append(ActionTiming(action, start, self.clock(), start - t0))
            self.sends = [(t, w) for t, w in self.sends if not w.is_completed()]
        self._post(self.groups[len(actions)])
        for _, work in self.sends:
            work.wait()
        return PipelineStepResult(self.loss_sum, self.count, timings,
                                  self.meter.peak_bytes if self.meter else None)

    # messages -------------------------------------------------------------------

    def _post(self, messages: Sequence) -> None:
        """Post this step's messages, in the pair order both sides share."""
        for m in messages:
            if m.send:
                tensor = self.produced.pop(m.action)
                self.sends.append((tensor, self.comm.isend(tensor, m.peer, m.tag)))
            else:
                buf = self.comm.empty(*self.shape, dtype=self.dtype)
                self.recvs[m.peer, m.tag] = (buf, self.comm.irecv(buf, m.peer, m.tag))

    def _take_recv(self, action: Action) -> torch.Tensor:
        peer_tag = source(self.schedule, action)
        if peer_tag is None:  # handed over on this rank by the neighbouring chunk
            step = -1 if action.kind == FORWARD else 1
            return self.local.pop(Action(action.kind, action.chunk + step, action.micro))
        buf, work = self.recvs.pop(peer_tag)
        work.wait()
        return buf

    def _send(self, tensor: torch.Tensor, action: Action) -> None:
        """Keep ``action``'s output for the send the next group posts."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(f"chunk {action.chunk} produced {tuple(tensor.shape)} "
                             f"{tensor.dtype} but messages are {self.shape} {self.dtype}; "
                             "pass the real activation_shape / activation_dtype to "
                             "run_pipeline")
        if destination(self.schedule, action) is None:
            self.local[action] = tensor.detach()
        else:
            self.produced[action] = tensor.detach().contiguous()

    # compute --------------------------------------------------------------------

    def _forward_input(self, action: Action) -> torch.Tensor | None:
        if action.chunk == 0:
            return None
        return self._take_recv(action).requires_grad_()

    def _forward(self, action: Action, x: torch.Tensor | None) -> None:
        chunk, key = self.chunks[action.chunk], (action.chunk, action.micro)
        self.inputs[key] = x
        with self.saves or self.meter or contextlib.nullcontext():
            y = chunk(x, self.micro_batches[action.micro][0])
            if chunk.is_last:
                loss, count = self.loss_fn(y, self.micro_batches[action.micro][1])
                self.loss_sum = self.loss_sum + loss.detach().float()
                self.count = self.count + count
                y = loss if self.loss_scale is None else loss * self.loss_scale
        self.outputs[key] = y
        if not chunk.is_last:
            self._send(y, action)

    def _backward_grad(self, action: Action) -> torch.Tensor | None:
        if self.chunks[action.chunk].is_last:
            return None
        return self._take_recv(action)

    def _backward(self, action: Action, grad: torch.Tensor | None, *, last: bool) -> None:
        """The whole backward, or (split schedule) B: the input's gradient only."""
        key = (action.chunk, action.micro)
        out, x = self.outputs.pop(key), self.inputs.pop(key)
        if self.schedule.split:
            params = [p for p in self.chunks[action.chunk].parameters() if p.requires_grad]
            dx, self.deferred[key] = backward_input(out, grad, x, params, self.saves)
        else:
            with self.grad_sync(action.chunk, last):
                if out.requires_grad:  # else nothing before it trains (a frozen first chunk)
                    torch.autograd.backward(out, grad_tensors=grad)
            dx = None if x is None else x.grad
        if action.chunk > 0:
            if x is None:  # never: every chunk after the first received its input
                raise RuntimeError(f"{action} has no received input to send a gradient for")
            self._send(dx if dx is not None else torch.zeros_like(x), action)
