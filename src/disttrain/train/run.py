"""One run, assembled: the parts a loop drives, each built whole before it starts.

:class:`Run` is what :func:`~.assemble.assemble_run` returns and what the loops
(:mod:`.loops`) drive through :class:`~.loops.LoopHost`: a step over this rank's share
of the global batch, held-out evaluation, metrics records, checkpoints and signals, and
at the end the summary and the final weights.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..comm import CollectiveLedger, Communicator
from ..config import Config, RunPlan, TrainConfig
from ..data.sampler import eval_indices
from ..data.samples import fetch_samples
from ..faults import maybe_fail
from ..monitor import MetricsRecord
from ..monitor.record import ACTIVATIONS, RANK_COMPUTE_S, RANK_DATA_S, RANK_SAMPLES
from ..monitor.stats import StepStats
from ..monitor.trace import Tracer
from ..parallel.compose import Parallelized
from ..parallel.interfaces import OwnLoopInputs
from .batch import split_batch, to_device
from .cadence import CheckpointCadence
from .checkpointing import RunCheckpoints
from .cursor import DataCursor
from .nonfinite import NonFinitePolicy
from .optim import lr_at, set_lr
from .precision import autocast
from .preemption import SignalStop
from .report import RunReporter, banner_text
from .runtime import Runtime
from .step import StepRunner


@dataclass(frozen=True, kw_only=True)
class RunModel:
    """The model side of a run: the composition, its optimizer, the loss a step calls,
    the model's size and its training FLOPs per loss term (0: unknown)."""

    parallel: Parallelized
    optimizer: torch.optim.Optimizer
    parameters: int
    flops_per_term: float


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
    """A run's parts; implements :class:`~.loops.LoopHost`."""

    config: Config
    plan: RunPlan
    runtime: Runtime
    world: Communicator
    model: RunModel
    cursor: DataCursor
    stepper: StepRunner
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
    current_lr: float = 0.0

    @property
    def train(self) -> TrainConfig:
        return self.config.train

    @property
    def parallel(self) -> Parallelized:
        return self.model.parallel

    # ----------------------------------------------------------------- a step
    def train_step(self, step: int) -> StepStats:
        """One optimizer step on this rank's share of the global batch (0-based
        ``step``), then the sync mode's between-steps work."""
        return self.tally.during(lambda: self._step(step))

    def _step(self, step: int) -> StepStats:
        lr = lr_at(step, self.config.train, self.plan.lr)
        set_lr(self.model.optimizer, lr)
        self.current_lr = lr
        sync, cursor = self.parallel.sync, self.cursor
        selected = sync.select(step, cursor.share())
        lists = [] if selected is None else cursor.micro_batches(selected)
        cursor.follow(lists)
        with self.tracer.span("step", step=step + 1):
            # a rank sitting this step out does not step
            stats = StepStats() if selected is None else self.stepper.run(lists)
        self.nonfinite.after_step(step + 1, None if selected is None
                                  else self.stepper.nonfinite,
                                  self.stepper.nonfinite_skipped)
        if self.stepper.terms_are_samples:
            self.reporter.bar.unit = "samples"
        cursor.advance()
        done = step + 1
        sync.after_step(done, last=done == self.config.train.steps)
        self.reporter.telemetry.window.add(stats)
        self.reporter.bar.update(done, stats.loss, stats.terms, stats.total_s, lr=lr)
        self.reporter.step_end(MetricsRecord(
            step=done, lr=lr, loss=stats.loss if stats.terms else None,
            grad_norm=self.stepper.grad_norm, samples_seen=cursor.position))
        return stats

    def add_wall(self, seconds: float) -> None:
        self.reporter.telemetry.window.add_wall(seconds)

    def after_step(self, done: int) -> None:
        self.cadence.after_step(done, self.cursor.position)
        maybe_fail("train.step", self.runtime.rank, done)

    def stop_if_signalled(self, done: int) -> None:
        self.cadence.stop_if_signalled(done, self.cursor.position)

    def catching_signals(self) -> AbstractContextManager[None]:
        return self.signals.catching()

    def status(self, text: str) -> None:
        self.reporter.bar.status(text)

    def announce(self, initial_eval: float | None) -> None:
        self.reporter.say(banner_text(
            self.runtime.world_size, self.runtime.device, self.runtime.backend, self.plan,
            self.model.parameters, self.run_dir, self.parallel.layout_lines(),
            initial_eval))

    # ----------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, step: int) -> float | None:
        """Mean held-out loss over ``train.eval_samples`` samples, split across dp ranks;
        one all-reduce at the end, so uneven shares never desynchronise ranks."""
        value = self._held_out_loss()
        self.reporter.evaluated(step, value)
        return value

    def _held_out_loss(self) -> float | None:
        ev = self.evaluation
        if ev.dataset is None:
            return None
        module, dp = self.parallel.module, self.parallel.groups.dp
        module.eval()
        indices = eval_indices(len(ev.dataset), self.config.train.eval_samples, dp.rank,
                               dp.size)
        totals = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        size = self.plan.batch.micro_batch
        for start in range(0, len(indices), size):
            batch = ev.collate(fetch_samples(ev.dataset, indices[start:start + size]))
            with autocast(self.config.train.precision, self.runtime.device):
                loss_sum, count = self.stepper.eval_totals(
                    split_batch(to_device(batch, self.runtime.device), ev.call_kwargs))
            totals[0] += loss_sum
            totals[1] += count
        self.stepper.reduce_eval(totals)
        module.train()
        return float(totals[0] / totals[1].clamp(min=1))

    # ----------------------------------------------------------------- records
    def log(self, step: int, eval_loss: float | None) -> None:
        """A metrics record for step ``step`` (a collective: every rank calls it)."""
        window, scaler = self.reporter.telemetry.window, self.stepper.scaler
        per_step, wire_per_step = self.tally.since_logged(window.steps)
        record = MetricsRecord(
            step=step, lr=self.current_lr, grad_norm=self.stepper.grad_norm,
            samples_per_s=window.samples_per_s(self.plan.batch.global_batch),
            samples_seen=self.cursor.position, shares=list(self.cursor.splitter.shares),
            checkpoint_stall_s=self.checkpoints.stall_s,
            loss_scale=scaler.scale if scaler.enabled else None,
            skipped_steps=scaler.skipped if scaler.enabled else None,
            nonfinite_skipped=self.stepper.nonfinite_skipped or None,
            eval_loss=eval_loss,
            memory_mb={k: v / 2**20 for k, v in self.memory().items()},
            comm_bytes_per_step=per_step, comm_wire_bytes_per_step=wire_per_step,
        ).with_figures({**self.parallel.sync.metrics(),
                        **self.parallel.grads.comm_stats()})  # bytes sent, compression
        ranks = self.reporter.log(record, self.model.flops_per_term)
        self.cursor.splitter.update([r[RANK_SAMPLES] for r in ranks],
                                    [r[RANK_COMPUTE_S] + r[RANK_DATA_S] for r in ranks],
                                    self.plan.batch.micro_batch)

    def memory(self) -> dict[str, int]:
        """This rank's model state, and the most activation bytes it saved for backward
        (one micro-batch's forward; a pipeline stage's peak over its schedule)."""
        return {**self.parallel.grads.model_state_bytes(self.model.optimizer),
                ACTIVATIONS: self.stepper.activation_bytes or 0}

    # ----------------------------------------------------------------- own loop
    def own_loop_inputs(self) -> OwnLoopInputs:
        train, b = self.config.train, self.plan.batch
        return OwnLoopInputs(
            optimizer=self.model.optimizer, steps=train.steps, sampler=self.cursor.sampler,
            per_worker=b.global_batch // b.dp, micro_batch=b.micro_batch,
            compute=self.stepper.gradients,
            lr_at=lambda s: lr_at(s, train, self.plan.lr),
            log=self._own_loop_record, log_every=train.log_every)

    def _own_loop_record(self, record: MetricsRecord) -> None:
        """A record of such a loop (no per-step point: on_step_end gets it too)."""
        if record.loss is not None:  # always set: the loop's own figure
            self.reporter.bar.update(record.step, record.loss, lr=record.lr)
        self.reporter.write(record)

    def own_loop_done(self, samples: int, skipped: int) -> None:
        if skipped:
            self.reporter.say(f"{skipped} push(es) with a non-finite loss or gradient "
                              "norm were skipped")
        self.cursor.position = samples
