"""One run, assembled: the parts the loop drives, each built whole before it starts.

:class:`Run` is what :func:`~.assemble.assemble_run` returns: what a step runs on (read
by :func:`~.step.train_step`), held-out evaluation, metrics records, checkpoints and
signals, and at the end the summary and the final weights. A sync mode that runs its own
loop (parameter servers) is driven by :func:`run_own_loop`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..comm import CollectiveLedger, Communicator
from ..config import Config, RunPlan
from ..data.sampler import eval_indices
from ..data.samples import fetch_samples
from ..errors import DivergenceError
from ..faults import maybe_fail
from ..monitor import MetricsRecord
from ..monitor.record import ACTIVATIONS, RANK_COMPUTE_S, RANK_DATA_S, RANK_SAMPLES
from ..monitor.stats import StatsWindow, StepStats
from ..monitor.trace import Tracer
from ..parallel.compose import Parallelized
from ..parallel.ft.replicas import ReplicaGroups
from ..parallel.interfaces import OwnLoopInputs, RunsOwnLoop, WorkerGradients
from .batch import Batch, BatchLoss, split_batch, to_device
from .cadence import CheckpointCadence
from .checkpointing import RunCheckpoints
from .cursor import DataCursor
from .nonfinite import NonFinitePolicy
from .optim import lr_at
from .precision import LossScaler, autocast
from .preemption import SignalStop
from .report import RunReporter, banner_text, layout_lines
from .runtime import Runtime


@dataclass
class LoopResult:
    """What a run's loop reports, from which the run writes its summary."""

    initial_eval: float | None
    final_eval: float | None
    totals: StatsWindow
    final_loss: float
    wall_time: float


# the final train loss: the mean of the losses of this many last steps
RECENT_LOSSES = 10


@dataclass
class StepFacts:
    """What the host knows of the steps so far: the figures of the last step it read
    (one step late, or at a step where it acts), the steps skipped as non-finite, the
    activation bytes measured on the first pass, the losses of the last
    :data:`RECENT_LOSSES` steps read (a replica group healed from a peer takes the
    peer's)."""

    grad_norm: float = 0.0
    loss_scale: float = 1.0
    nonfinite_skipped: int = 0
    activation_bytes: int | None = None
    recent_losses: deque[float] = field(
        default_factory=lambda: deque[float](maxlen=RECENT_LOSSES))


@dataclass(frozen=True, kw_only=True)
class RunModel:
    """The model side of a run: the composition, its optimizer, the loss a step calls,
    the model's size and its training FLOPs per loss term (0: unknown)."""

    parallel: Parallelized
    optimizer: torch.optim.Optimizer
    parameters: int
    flops_per_token: float


@dataclass(frozen=True, kw_only=True)
class EvalData:
    """Held-out samples (None: no evaluation) and how a list of them becomes a batch."""

    dataset: Any
    collate: Any
    call_kwargs: Any


@dataclass
class CommTally:
    """The ledger's payload and wire bytes of the steps, and what the last record
    already reported."""

    ledger: CollectiveLedger
    step_bytes: int = 0
    step_wire: int = 0
    logged_bytes: int = 0
    logged_wire: int = 0

    def during(self, work: Any) -> Any:
        sent, wire = self.ledger.payload_bytes, self.ledger.wire_sent_bytes
        out = work()
        self.step_bytes += self.ledger.payload_bytes - sent
        self.step_wire += self.ledger.wire_sent_bytes - wire
        return out

    def since_logged(self, steps: int) -> tuple[float, float]:
        """Payload and wire bytes per step since the last record (``steps`` of them)."""
        out = ((self.step_bytes - self.logged_bytes) / max(steps, 1),
               (self.step_wire - self.logged_wire) / max(steps, 1))
        self.logged_bytes, self.logged_wire = self.step_bytes, self.step_wire
        return out


@dataclass(kw_only=True)
class Run:
    """A run's parts. What a step runs on: the composition and optimizer (``model``),
    the sample order (``cursor``), ``load`` (a micro-batch's indices -> a batch on the
    device), ``loss`` (a micro-batch's summed loss and terms), the fp16 ``scaler``, and
    ``figures``, which bring each step's figures to the host; ``facts``: what the host
    has read of them."""

    config: Config
    plan: RunPlan
    runtime: Runtime
    world: Communicator
    model: RunModel
    cursor: DataCursor
    load: Callable[[list[int]], Batch]
    loss: BatchLoss
    scaler: LossScaler
    figures: Any  # step.FigureCopies
    reporter: RunReporter
    checkpoints: RunCheckpoints
    cadence: CheckpointCadence
    nonfinite: NonFinitePolicy
    signals: SignalStop
    tracer: Tracer
    evaluation: EvalData
    run_dir: Path
    start_step: int
    tally: CommTally
    facts: StepFacts
    # parallel.fault_tolerance = replica: joins the replica groups (None: off); called
    # by the loop before its first step, after the initial evaluation, so a (re)started
    # group heartbeats to the lighthouse only once it can step: a quorum never waits
    # for a group still evaluating
    join_replicas: Callable[[], ReplicaGroups] | None = None
    # the quorum each step runs under, from join_replicas (None: off, or not joined yet)
    replicas: ReplicaGroups | None = None

    @property
    def parallel(self) -> Parallelized:
        return self.model.parallel

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    def after_step(self, done: int) -> None:
        self.cadence.after_step(done, self.cursor.position)
        maybe_fail("train.step", self.runtime.rank, done)

    def announce(self, initial_eval: float | None) -> None:
        self.reporter.say(banner_text(
            self.runtime.world_size, self.runtime.device, self.runtime.backend, self.plan,
            self.model.parameters, self.run_dir,
            layout_lines(self.parallel, self.plan.layout, self.plan.batch.grad_accum),
            initial_eval))

    # ----------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, step: int) -> float | None:
        """Mean held-out loss over ``train.eval_samples`` samples, split across the ranks
        that split the batch; one all-reduce at the end, so uneven shares never
        desynchronise ranks."""
        value = self._held_out_loss()
        self.reporter.evaluated(step, value)
        return value

    def _held_out_loss(self) -> float | None:
        ev = self.evaluation
        if ev.dataset is None:
            return None
        module, samples = self.parallel.module, self.parallel.groups.samples
        module.eval()
        indices = eval_indices(len(ev.dataset), self.config.train.eval_samples,
                               samples.rank, samples.size)
        totals = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        size = self.plan.batch.micro_batch
        for start in range(0, len(indices), size):
            batch = ev.collate(fetch_samples(ev.dataset, indices[start:start + size]))
            with autocast(self.config.train.precision, self.runtime.device):
                loss_sum, count = self.parallel.passes.eval_loss(
                    split_batch(to_device(batch, self.runtime.device), ev.call_kwargs),
                    self.loss)
            totals[0] += loss_sum
            totals[1] += count
        self.parallel.passes.eval_comm.all_reduce(totals)
        module.train()
        return float(totals[0] / totals[1].clamp(min=1))

    # ----------------------------------------------------------------- records
    def log(self, step: int, eval_loss: float | None) -> None:
        """A metrics record for step ``step`` (a collective: every rank calls it)."""
        window, scaler, facts = self.reporter.telemetry.window, self.scaler, self.facts
        per_step, wire_per_step = self.tally.since_logged(window.steps)
        record = MetricsRecord(
            step=step, lr=lr_at(step - 1, self.config.train, self.plan.lr),
            grad_norm=facts.grad_norm,
            samples_per_s=window.samples_per_s(self.plan.batch.global_batch),
            samples_seen=self.cursor.position, shares=list(self.cursor.splitter.shares),
            checkpoint_stall_s=self.checkpoints.stall_s,
            loss_scale=facts.loss_scale if scaler.enabled else None,
            skipped_steps=scaler.skipped if scaler.enabled else None,
            nonfinite_skipped=facts.nonfinite_skipped or None,
            eval_loss=eval_loss,
            memory_mb={k: v / 2**20 for k, v in self.memory().items()},
            comm_bytes_per_step=per_step, comm_wire_bytes_per_step=wire_per_step,
        ).with_figures({**self.parallel.sync.metrics(),
                        **self.parallel.grads.comm_stats(),  # bytes sent, compression
                        **(self.replicas.record_figures() if self.replicas is not None else {})})
        ranks = self.reporter.log(record, self.model.flops_per_token)
        self.cursor.splitter.update([r[RANK_SAMPLES] for r in ranks],
                                    [r[RANK_COMPUTE_S] + r[RANK_DATA_S] for r in ranks],
                                    self.plan.batch.micro_batch)

    def memory(self) -> dict[str, int]:
        """This rank's model state, and the most activation bytes it saved for backward
        (one micro-batch's forward; a pipeline stage's peak over its schedule)."""
        return {**self.parallel.grads.model_state_bytes(self.model.optimizer),
                ACTIVATIONS: self.facts.activation_bytes or 0}

    # ----------------------------------------------------------------- own loop
    def own_loop_inputs(self, compute: WorkerGradients) -> OwnLoopInputs:
        train, b = self.config.train, self.plan.batch
        return OwnLoopInputs(
            optimizer=self.model.optimizer, steps=train.steps, sampler=self.cursor.sampler,
            per_worker=b.global_batch // b.shares, micro_batch=b.micro_batch,
            compute=compute, lr_at=lambda s: lr_at(s, train, self.plan.lr),
            log=self._own_loop_record, log_every=train.log_every)

    def _own_loop_record(self, record: MetricsRecord) -> None:
        """A record of such a loop (no per-step point: on_step_end gets it too)."""
        if record.loss is not None:  # always set: the loop's own figure
            self.reporter.bar.update(record.step, record.loss, lr=record.lr)
        self.reporter.write(record)


def run_own_loop(run: Run, mode: RunsOwnLoop, compute: WorkerGradients) -> LoopResult:
    """The loop of a sync mode that runs its own (parameter servers and workers, each
    worker's gradients from ``compute``): held-out evaluations at its start and end, no
    checkpoints."""
    start = time.perf_counter()
    initial_eval = run.evaluate(0)
    run.announce(initial_eval)
    result = mode.run_loop(run.own_loop_inputs(compute))
    if result.diverged is not None:  # every rank holds the same result
        raise DivergenceError(*result.diverged)
    if result.nonfinite_skipped:
        run.reporter.say(f"{result.nonfinite_skipped} push(es) with a non-finite loss or "
                         "gradient norm were skipped")
    run.cursor.position = result.samples
    totals = StatsWindow()
    totals.add(StepStats(terms=result.terms, positions=result.positions,
                         total_s=result.loop_s))
    totals.add_wall(result.loop_s)
    final_eval = run.evaluate(run.config.train.steps)
    return LoopResult(initial_eval, final_eval, totals, result.train_loss,
                      time.perf_counter() - start)
