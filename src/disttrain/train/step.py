"""One training step, read top to bottom in :func:`train_step`, and the loop that runs
the steps (:func:`run_steps`).

A step is queued on the device and never waits for it: the gradient norm, the clip
factor and the non-finite decision stay device tensors, and the optimizer's update is
gated on the device (a skipped step changes no parameter and no optimizer state). The
step's figures (loss, loss terms, norm, flags, loss scale) travel to the host without
blocking; the loop reads step N's while step N+1 runs, or at once at a step where it
must act on them (a record, an evaluation, a checkpoint, the last step, a signal), so a
checkpoint is committed only after the host has seen every step it holds as finite.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import nonfinite_what
from ..faults import maybe_slow_down
from ..monitor import MetricsRecord
from ..monitor.stats import StatsWindow, StepStats
from .batch import Batch
from .optim import lr_at, set_lr, step_unless
from .precision import autocast
from .run import LoopResult, Run

# a step's figures, in the order they travel to the host: the summed loss, the loss
# terms, the positions the loss ran over (counted or not: what tokens/s counts; all
# three over the ranks that share gradients), the global gradient norm, whether the
# loss / the gradients were non-finite (1.0 / 0.0), the loss scale it ran under
FIGURES = ("loss_sum", "terms", "positions", "grad_norm", "bad_loss", "bad_grads",
           "loss_scale")


def train_step(run: Run, step: int) -> StepInFlight:
    """Optimizer step ``step`` (0-based) on this rank's share of the global batch, then
    the sync mode's between-steps work. Queued on the device: nothing it computes is
    read here; the returned :class:`StepInFlight` brings the figures to the host."""
    train, par = run.config.train, run.parallel
    grads, optimizer, scaler, device = par.grads, run.model.optimizer, run.scaler, run.device
    lr = lr_at(step, train, run.plan.lr)
    set_lr(optimizer, lr)
    replicas = run.replicas  # fault tolerance (None: off): the step's quorum has formed
    if replicas is not None:  # a missing group's share goes to those present
        run.cursor.window = replicas.window(run.plan.batch.global_batch)
    selected = par.sync.select(step, run.cursor.share())
    lists = [] if selected is None else run.cursor.micro_batches(selected)
    run.cursor.follow(lists)
    stats = StepStats(samples=sum(len(m) for m in lists))
    flags = torch.zeros(2, dtype=torch.float64, device=device)  # bad loss, bad grads
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, terms, positions
    norm = torch.zeros((), dtype=torch.float64, device=device)
    ledger = run.tally.ledger
    t0, waited0 = time.perf_counter(), ledger.wait_seconds
    with run.tracer.span("step", step=step + 1):
        if selected is not None:  # else this rank sits the step out (a federated round)
            grads.zero_grad()
            # Forward and backward of every micro-batch, through the module or the
            # pipeline schedule; each adds its summed loss and loss terms to ``totals``,
            # whose reduction over the ranks that share gradients starts before the
            # last backward, so it overlaps it.
            handle, measured = par.passes.forward_backward(
                [_loader(run, m, stats) for m in lists], run.loss, totals, scaler.scale,
                lambda: autocast(train.precision, device),
                measure=run.facts.activation_bytes is None)
            if measured is not None:
                run.facts.activation_bytes = measured
            maybe_slow_down(run.runtime.rank, time.perf_counter() - t0 - stats.data_s,
                            stats.samples)
            if handle is not None:
                handle.wait()
            if replicas is not None:  # the terms of every replica group present
                replicas.reduce_totals(totals)
            # The loss normalisation. The loss is a sum over loss terms (target tokens,
            # or samples), L = sum_i l_i over the N terms of the whole global batch (all
            # micro-batches of all dp ranks), and the step follows the mean, L / N. Each
            # rank's backward gives the gradient of its own part of the sum; the
            # reduction sums them, and scaling by 1 / N (N = totals[1] after its
            # reduction) gives the gradient of the mean: the same update however the
            # global batch is split into ranks and micro-batches. fp16 multiplied the
            # loss by the loss scale before backward; it is divided out here too.
            denominator = totals[1].clamp(min=1.0)
            if scaler.scale is not None:
                denominator = denominator * scaler.scale
            grads.finish_gradient_sync(1.0 / denominator)
            if replicas is not None:  # each group's part of the mean, summed
                replicas.reduce_gradients([g for _, g in grads.gradient_pieces()])
        t_opt, waited_mid = time.perf_counter(), ledger.wait_seconds
        stats.compute_s = t_opt - t0 - stats.data_s - (waited_mid - waited0)
        with run.tracer.span("optimizer"):
            if selected is not None:
                norm = torch.as_tensor(grads.clip_grad_norm(train.grad_clip),
                                       dtype=torch.float64, device=device).reshape(())
                # The non-finite decision, on the device: a nan / inf loss or gradient
                # norm skips the update (under fp16 an overflowed gradient is the loss
                # scaler's to skip, a non-finite loss a divergence). Every rank that
                # shares gradients sees the same totals and the same global norm, so
                # they decide alike without a collective.
                flags[0] = (~torch.isfinite(totals[0])).double()
                flags[1] = (~torch.isfinite(norm)).double()
            # torchft's commit: False when a replica failed inside the step's
            # reduction; the step then changes nothing and is taken again
            committed = replicas is None or replicas.commit(step + 1)
            if selected is not None and committed:
                run.checkpoints.before_update()  # an async save has its snapshot
                step_unless(optimizer, flags.amax())
                grads.after_optimizer_step()
                scaler.update(overflow=flags[1] > 0, counted=flags[0] == 0)
            if run.nonfinite.agree:  # replicas step apart: the stop is decided together
                run.nonfinite.agree_on(flags)
        stats.optim_s = time.perf_counter() - t_opt - (ledger.wait_seconds - waited_mid)
        stats.total_s = time.perf_counter() - t0
        stats.comm_s = ledger.wait_seconds - waited0
    done = step + 1
    if committed:
        run.cursor.advance()
        par.sync.after_step(done, last=done == train.steps)
    scale = scaler.scale if scaler.scale is not None else torch.ones((), device=device)
    figures = torch.cat([totals, norm.reshape(1), flags, scale.double().reshape(1)])
    return StepInFlight(done=done, lr=lr, stats=stats, sat_out=selected is None,
                        position=run.cursor.position, copy=run.figures.send(figures),
                        committed=committed)


def _loader(run: Run, indices: list[int], stats: StepStats) -> Callable[[], Batch]:
    """A micro-batch's loading, when the pass asks for it, timed as ``stats.data_s``."""
    def load() -> Batch:
        started = time.perf_counter()
        with run.tracer.span("data"):
            batch = run.load(indices)
        stats.data_s += time.perf_counter() - started
        return batch
    return load


class FigureCopies:
    """Each step's figures (:data:`FIGURES`, a float64 vector on the device) copied to
    the host without blocking, into one of two host buffers (pinned on a GPU, so the
    copy really is asynchronous); read once the copy's event says it arrived. At most
    one step's figures wait unread while the next step's are sent."""

    def __init__(self, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.buffers = [torch.empty(len(FIGURES), dtype=torch.float64, pin_memory=pinned)
                        for _ in range(2)]
        self.unread = [False, False]
        self.next = 0

    def send(self, values: torch.Tensor) -> FigureCopy:
        slot = self.next
        if self.unread[slot]:
            raise RuntimeError("a step's figures were sent before the one two steps "
                               "earlier was read (at most one step stays unread)")
        self.next, self.unread[slot] = 1 - slot, True
        self.buffers[slot].copy_(values, non_blocking=True)
        event = None
        if values.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return FigureCopy(self, slot, event)


@dataclass
class FigureCopy:
    """One step's figures on their way to the host."""

    copies: FigureCopies
    slot: int
    event: torch.cuda.Event | None

    def read(self) -> dict[str, float]:
        """The figures by name; waits for the copy (and so for that step) if needed."""
        if self.event is not None:
            self.event.synchronize()
        self.copies.unread[self.slot] = False
        return dict(zip(FIGURES, self.copies.buffers[self.slot].tolist(), strict=True))


@dataclass
class StepInFlight:
    """A step queued on the device: its host-side timings, its learning rate, where
    the sample order stood after it, and its figures on their way to the host."""

    done: int  # 1-based: the step's number once done
    lr: float
    stats: StepStats
    sat_out: bool  # this rank took no part (a federated client out of the round)
    position: int
    copy: FigureCopy
    committed: bool = True  # False: a replica failed inside it; taken again


def learn(run: Run, flight: StepInFlight, totals: StatsWindow) -> None:
    """What the host does with a step's figures once they arrived: the non-finite
    policy (stop, naming the step, or count the skip), the loss and its terms into the
    windows, the progress line and the callbacks' per-step record."""
    f, stats, done = flight.copy.read(), flight.stats, flight.done
    what = nonfinite_what(bool(f["bad_loss"]), bool(f["bad_grads"]), run.scaler.enabled)
    if not flight.sat_out:
        run.scaler.count_skipped(bool(f["bad_grads"]) and not f["bad_loss"])
        run.facts.grad_norm, run.facts.loss_scale = f["grad_norm"], f["loss_scale"]
        if what is not None:
            run.facts.nonfinite_skipped += 1
    run.nonfinite.after_step(done, what, run.facts.nonfinite_skipped)
    if not flight.sat_out:
        stats.terms, stats.positions = int(f["terms"]), int(f["positions"])
        stats.loss = f["loss_sum"] / max(f["terms"], 1.0)
    totals.add(stats)
    # a rank that sat the step out has no loss; a skipped nan step none
    if stats.terms and math.isfinite(stats.loss):
        run.facts.recent_losses.append(stats.loss)
    if run.loss.terms_are_samples:
        run.reporter.bar.unit = "samples"
    run.reporter.telemetry.window.add(stats)
    run.reporter.bar.update(done, stats.loss, stats.terms, stats.total_s, lr=flight.lr)
    run.reporter.step_end(MetricsRecord(
        step=done, lr=flight.lr, loss=stats.loss if stats.terms else None,
        grad_norm=run.facts.grad_norm, samples_seen=flight.position))


# train.eval_every = 0: about this many held-out evaluations in a run (after the one
# before the first step), so the held-out curve has points, not just its two ends
AUTO_EVALUATIONS = 10


def eval_interval(eval_every: int, steps: int, log_every: int) -> int:
    """Steps between held-out evaluations: ``eval_every``, or for 0 the smallest
    multiple of ``log_every`` at least ``steps / AUTO_EVALUATIONS`` (so evaluations
    fall on logged steps and add no records)."""
    if eval_every > 0:
        return eval_every
    target = max(1, steps // AUTO_EVALUATIONS)
    return log_every * math.ceil(target / log_every)


def run_steps(run: Run) -> LoopResult:
    """``train.steps`` optimizer steps from ``run.start_step``; evaluation, checkpoints
    and metrics records at their cadences.

    Each step's wall time runs from the end of the previous one's timing to the end of
    its own checkpoint work, less its evaluation: it holds the step, reading the
    previous step's figures (which waits for the device to finish it), any wait for
    other ranks at the boundary, logging and saving."""
    start, train = time.perf_counter(), run.config.train
    run.reporter.bar.status("first evaluation...")
    last_eval = run.evaluate(run.start_step)
    initial_eval = last_eval
    run.announce(initial_eval)
    if run.join_replicas is not None:  # fault tolerance: heartbeats start now
        run.replicas = run.join_replicas()
    totals = StatsWindow()
    every_eval = eval_interval(train.eval_every, train.steps, train.log_every)
    pending: StepInFlight | None = None
    with run.signals.catching():
        mark, step = time.perf_counter(), run.start_step
        while step < train.steps:
            if run.replicas is not None:  # the step's quorum; a group behind heals here
                step = run.replicas.start_step(step)
                if step >= train.steps:
                    break
            flight = run.tally.during(lambda step=step: train_step(run, step))
            if pending is not None:  # read while this step runs on the device
                learn(run, pending, totals)
                pending = None
            if not flight.committed:  # nothing to learn: the step is taken again
                flight.copy.read()
                continue
            pending, done = flight, step + 1
            step = done
            last = done == train.steps
            evaluate_now = done % every_eval == 0 or last
            log_now = done % train.log_every == 0 or last or evaluate_now
            stopping = not last and run.cadence.signalled(done)
            if log_now or evaluate_now or stopping or run.checkpoints.due(done):
                learn(run, pending, totals)  # the host acts on this step now
                pending = None
            evaluating = 0.0
            if evaluate_now:
                started = time.perf_counter()
                last_eval = run.evaluate(done)
                evaluating = time.perf_counter() - started
            run.after_step(done)
            now = time.perf_counter()
            totals.add_wall(now - mark - evaluating)
            run.reporter.telemetry.window.add_wall(now - mark - evaluating)
            mark = now
            if log_now:
                run.log(done, last_eval if evaluate_now else None)
            if stopping:
                run.cadence.stop(done, run.cursor.position)
        if run.replicas is not None and step >= train.steps:  # fault tolerance: the
            run.replicas.finish()  # groups missing at the end rejoin before any leaves
    # a replica group healed at the last step trained none: its window is the peer's
    recent = run.facts.recent_losses
    final_loss = sum(recent) / len(recent) if recent else float("nan")
    return LoopResult(initial_eval, last_eval, totals, final_loss,
                      time.perf_counter() - start)


def worker_gradients(run: Run, micro_batches: list[list[int]]
                     ) -> tuple[float, int, float, int]:
    """Forward and backward only (a worker's half of a step whose update is made
    elsewhere, by a parameter server): leaves this rank's gradient, normalised by its
    own loss-term count and clipped, in ``.grad``; returns (summed loss, loss terms,
    the gradient's norm before clipping, the positions the loss ran over), read on the
    host (the server needs them)."""
    grads, device = run.parallel.grads, run.device
    grads.zero_grad()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    stats = StepStats()
    handle, _ = run.parallel.passes.forward_backward(
        [_loader(run, m, stats) for m in micro_batches], run.loss, totals, None,
        lambda: autocast(run.config.train.precision, device), measure=False)
    if handle is not None:
        handle.wait()
    loss, count, positions = totals.tolist()
    grads.finish_gradient_sync(1.0 / max(count, 1.0))
    norm = float(grads.clip_grad_norm(run.config.train.grad_clip))
    return loss, int(count), norm, int(positions)
