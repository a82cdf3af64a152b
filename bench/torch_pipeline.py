"""disttrain's pipeline and ``torch.distributed.pipelining`` training the same chunks.

The one place that builds and steps both systems, for ``bench/pp_vs_torch.py`` (which
times them) and ``tests/parallel/test_pipeline_torch.py`` (which checks that both
train the same model), so the test checks what the bench times::

    trainers = build_pair(make_model, spec, comm, schedule="1f1b", m=8, v=1,
                          cuts=None, activation_shape=(b, T, d), loss_fn=token_loss,
                          make_optimizer=lambda params: torch.optim.AdamW(params))
    for batches in data:                 # [(input_ids [b, T], targets [b, T])] * m
        for trainer in trainers:         # disttrain, then torch
            stats = trainer.step(batches)

Each system gets its own model from ``make_model()`` (called once per system, so it
must build the same weights each time: seed inside it), cut by one :class:`StagePlan`
into the same :class:`PipelineChunk` modules. disttrain runs them with
:func:`run_pipeline`; torch wraps each chunk in a ``PipelineStage`` (stage index = the
chunk's global index, so chunk c lives on pp rank c % pp for both) and runs
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble`` (zb1: its ZB1P with one stage per rank) or
``ScheduleZBVZeroBubble`` (zbv: the same V, stages r and 2 pp - 1 - r on rank r) over
them with ``scale_grads=False``. Both backpropagate ``loss_sum * loss_scale`` (``loss_scale`` =
1 / the step's loss terms, so the gradient is that of the mean token loss), sum the
tied embedding/head gradients between the first and last stage
(:func:`sync_tied_grads`) and step their own optimizer. A step is zero_grad, the
schedule, the tied-gradient sum and the optimizer step.

Timing, the same for both (:class:`StepStats`): ``busy`` is the seconds this rank
spent computing its chunks, every forward (the loss included, on the last chunk) and
every backward (input and weight passes), each read around the library's own
per-action call (disttrain: its :class:`ActionTiming` spans, from the received input
to the output handed to the send; torch: ``forward_one_chunk`` / ``backward_one_chunk``
/ ``backward_weight_one_chunk`` and the loss function); time blocked on a receive is
not busy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from disttrain.comm.collectives import Communicator
from disttrain.names import (
    SCHEDULE_1F1B,
    SCHEDULE_GPIPE,
    SCHEDULE_INTERLEAVED,
    SCHEDULE_ZB1,
    SCHEDULE_ZBV,
)
from disttrain.parallel.pipeline.build import build_chunks
from disttrain.parallel.pipeline.chunks import PipelineChunk
from disttrain.parallel.pipeline.cuts import plan_stages
from disttrain.parallel.pipeline.runner import LossFn, run_pipeline
from disttrain.parallel.pipeline.schedules import V_SCHEDULES, build_schedule
from disttrain.parallel.pipeline.tied import sync_tied_grads
from disttrain.spec import ModelSpec
from disttrain.targets import IGNORE_INDEX

DISTTRAIN, TORCH = "disttrain", "torch"
MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]
_clock = time.perf_counter  # one clock for every process of a Linux host


@dataclass(frozen=True)
class StepStats:
    """One rank's view of one training step (``time.perf_counter`` seconds).

    ``loss_sum``: its micro-batches' summed (unscaled) loss, 0 unless it holds the last
    chunk; ``count``: their loss terms (0 likewise); ``start``: the step's start;
    ``pipeline_end``: when the schedule returned (before the tied-gradient sum);
    ``end``: after the optimizer step; ``busy``: compute seconds (module docstring);
    ``cpu``: the CPU seconds this process used in the step, all its threads
    (``time.process_time``: unlike wall time, hardly changed by other work on the
    machine, so it compares the two systems' costs on a loaded machine).
    """

    loss_sum: float
    count: int
    start: float
    pipeline_end: float
    end: float
    busy: float
    cpu: float

    def as_tensor(self) -> torch.Tensor:
        """[loss_sum, count, start, pipeline_end, end, busy, cpu] in float64 (to
        gather)."""
        return torch.tensor([self.loss_sum, self.count, self.start, self.pipeline_end,
                             self.end, self.busy, self.cpu], dtype=torch.float64)


@dataclass(frozen=True)
class ScheduleRun:
    """What one run of a schedule returns: this rank's loss sum (0-dim) and loss terms,
    and its busy seconds."""

    loss_sum: torch.Tensor
    count: int
    busy: float


class ScheduleRunner(Protocol):
    """Runs one step's micro-batches through a pipeline schedule, accumulating the
    gradients of ``loss_sum * loss_scale`` in the chunks' parameters."""

    def __call__(self, batches: MicroBatches, loss_scale: float) -> ScheduleRun: ...


class PipelineTrainer:
    """One system's training step over this rank's ``chunks``."""

    def __init__(self, name: str, chunks: Sequence[PipelineChunk], runner: ScheduleRunner,
                 optimizer: torch.optim.Optimizer, comm: Communicator) -> None:
        self.name, self.chunks, self.runner = name, list(chunks), runner
        self.optimizer, self.comm = optimizer, comm

    def step(self, batches: MicroBatches) -> StepStats:
        """zero_grad, the schedule, the tied-gradient sum, the optimizer step."""
        start, cpu = _clock(), time.process_time()
        self.optimizer.zero_grad(set_to_none=True)
        run = self.runner(batches, 1.0 / loss_terms(batches))
        pipeline_end = _clock()
        sync_tied_grads(self.chunks, self.comm)
        self.optimizer.step()
        end = _clock()
        return StepStats(float(run.loss_sum), run.count, start, pipeline_end, end, run.busy,
                         time.process_time() - cpu)


def loss_terms(batches: MicroBatches) -> int:
    """The step's loss terms: targets that are not ``IGNORE_INDEX``."""
    return max(1, sum(int((targets != IGNORE_INDEX).sum()) for _, targets in batches))


class DisttrainRunner:
    """:func:`run_pipeline` over the chunks (as the trainer runs it after its first
    step: without counting the activation bytes)."""

    def __init__(self, chunks: Sequence[PipelineChunk], comm: Communicator, schedule: str,
                 *, m: int, v: int, activation_shape: Sequence[int], loss_fn: LossFn,
                 measure_activations: bool = False) -> None:
        self.chunks, self.comm, self.loss_fn = list(chunks), comm, loss_fn
        self.measure_activations = measure_activations
        self.schedule = build_schedule(schedule, pp=comm.size, m=m, v=v)
        self.activation_shape = tuple(activation_shape)

    def __call__(self, batches: MicroBatches, loss_scale: float) -> ScheduleRun:
        result = run_pipeline(self.chunks, batches, self.loss_fn, self.comm, self.schedule,
                              activation_shape=self.activation_shape, loss_scale=loss_scale,
                              measure_activations=self.measure_activations)
        return ScheduleRun(result.loss_sum, int(result.count),
                           sum(t.end - t.start for t in result.timings))


class _TimedStage(PipelineStage):
    """torch's ``PipelineStage``, adding the seconds of each forward and backward
    chunk call to ``busy``."""

    busy = 0.0

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = _clock()
        try:
            yield
        finally:
            self.busy += _clock() - t0

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed():
            return super().backward_weight_one_chunk(*args, **kwargs)


class _ScaledLoss:
    """torch's ``loss_fn(output, target)``: ``loss_fn``'s sum times the step's scale;
    counts the sum, the terms and its own seconds (the schedule calls it outside
    ``forward_one_chunk``)."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.reset(1.0)

    def reset(self, scale: float) -> None:
        self.scale, self.loss_sum, self.count, self.busy = scale, torch.zeros(()), 0, 0.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        t0 = _clock()
        loss, count = self.loss_fn(output, target)
        self.loss_sum = self.loss_sum + loss.detach().float()
        self.count += int(count)
        scaled = loss * self.scale
        self.busy += _clock() - t0
        return scaled


class TorchRunner:
    """``torch.distributed.pipelining`` over the same chunks: one ``PipelineStage`` per
    chunk, the schedule class of the same name (``TORCH_SCHEDULES``)."""

    def __init__(self, chunks: Sequence[PipelineChunk], comm: Communicator, schedule: str,
                 *, m: int, n_chunks: int, activation_shape: Sequence[int],
                 loss_fn: LossFn) -> None:
        self.stages = [_TimedStage(ch, ch.index, n_chunks, comm.device, *_shapes(
            ch, activation_shape, comm.device), group=comm.group) for ch in chunks]
        self.loss = _ScaledLoss(loss_fn)
        self.has_first = any(ch.is_first for ch in chunks)
        self.has_last = any(ch.is_last for ch in chunks)
        cls = TORCH_SCHEDULES[schedule]
        if schedule in (SCHEDULE_INTERLEAVED, SCHEDULE_ZB1, SCHEDULE_ZBV):
            self.schedule: Any = cls(self.stages, m, loss_fn=self.loss, scale_grads=False)
        else:
            self.schedule = cls(self.stages[0], m, loss_fn=self.loss, scale_grads=False)

    def __call__(self, batches: MicroBatches, loss_scale: float) -> ScheduleRun:
        self.loss.reset(loss_scale)
        for stage in self.stages:
            stage.busy = 0.0
        args = (torch.cat([x for x, _ in batches]),) if self.has_first else ()
        target = torch.cat([t for _, t in batches]) if self.has_last else None
        self.schedule.step(*args, target=target, return_outputs=False)
        busy = sum(stage.busy for stage in self.stages) + self.loss.busy
        return ScheduleRun(self.loss.loss_sum, self.loss.count, busy)


def _shapes(chunk: PipelineChunk, activation_shape: Sequence[int], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of ``chunk`` for a ``PipelineStage`` given its shapes up
    front (torch's static mode: no shape inference, whose extra forward on the first
    step would also call the loss function once more). A received activation and every
    output require grad; the first chunk's input is token ids [b, T]."""
    b, t, *_ = activation_shape
    x = (torch.zeros(b, t, dtype=torch.long, device=device) if chunk.is_first
         else torch.zeros(*activation_shape, device=device))
    with torch.no_grad():
        y = chunk(x)
    return (x if chunk.is_first else x.requires_grad_()), torch.empty_like(y).requires_grad_()


TORCH_SCHEDULES: dict[str, Any] = {SCHEDULE_GPIPE: ScheduleGPipe, SCHEDULE_1F1B: Schedule1F1B,
                                   SCHEDULE_INTERLEAVED: ScheduleInterleaved1F1B,
                                   SCHEDULE_ZB1: ScheduleInterleavedZeroBubble,
                                   SCHEDULE_ZBV: ScheduleZBVZeroBubble}


def build_pair(make_model: Callable[[], nn.Module], spec: ModelSpec, comm: Communicator,
               *, schedule: str, m: int, v: int, cuts: Iterable[int] | None,
               activation_shape: Sequence[int], loss_fn: LossFn,
               make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
               ) -> list[PipelineTrainer]:
    """[disttrain's trainer, torch's], each on its own ``make_model()`` cut at ``cuts``
    (``plan_stages``' cut points; None balances the spec's costs) into ``comm.size x
    v`` chunks; this rank (``comm.rank`` of the pp group) holds chunks rank, rank + pp,
    ... of each (in a V for zbv). ``make_optimizer`` gets this rank's chunks' parameters."""
    plan = plan_stages(spec, pp=comm.size, v=v, cuts=None if cuts is None else list(cuts),
                       vshape=schedule in V_SCHEDULES)
    trainers = []
    for name in (DISTTRAIN, TORCH):
        chunks = build_chunks(make_model(), spec, plan, comm.rank)
        runner: ScheduleRunner
        if name == DISTTRAIN:
            runner = DisttrainRunner(chunks, comm, schedule, m=m, v=v,
                                     activation_shape=activation_shape, loss_fn=loss_fn)
        else:
            runner = TorchRunner(chunks, comm, schedule, m=m, n_chunks=plan.n_chunks,
                                 activation_shape=activation_shape, loss_fn=loss_fn)
        params = [p for ch in chunks for p in ch.parameters()]
        trainers.append(PipelineTrainer(name, chunks, runner, make_optimizer(params), comm))
    return trainers
