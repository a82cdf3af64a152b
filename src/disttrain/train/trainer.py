"""The training loop: any ``nn.Module``, any map-style dataset, an optional loss.

    trainer = disttrain.Trainer(model, dataset, loss_fn, {"train": {"steps": 100}})
    summary = trainer.fit()

A batch is what ``collate_fn`` (default: stacks mapping samples, else torch's
``default_collate``) makes of a micro-batch's samples (fetched in one ``__getitems__``
call where the dataset has one, as a Hugging Face ``datasets.Dataset`` does): a pair
``(inputs, targets)``, called as ``model(inputs)``, or a mapping whose entries other
than ``labels`` / ``targets`` are the model's keyword arguments (see :mod:`.batch`).
``loss_fn(outputs, targets)`` returns either the mean loss over the micro-batch's
samples or a pair ``(summed loss, number of loss terms)`` (e.g. target tokens); without
one, the causal-LM loss over the counted label tokens. Gradients are normalised by the
global number of loss terms in the step, so the update is the same on any number of
ranks and with any accumulation split.

The Trainer builds the composition (:func:`disttrain.parallel.compose`: this rank's part
of the model, its gradient synchronisation and training state), then runs the loop the
composition asks for (:mod:`.loops`); it uses the strategies only through their
declared interfaces.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ..comm import CollectiveLedger, Communicator, ReduceOp, control_beside
from ..config import Config, RunPlan, load_config
from ..config.dump import config_to_toml
from ..errors import CheckpointSaveError, DivergenceError, Interrupted, UserError
from ..data.samples import fetch_samples, tensor_rows
from ..data.sampler import GlobalOrderSampler, eval_indices
from ..spec import ModelSpec, spec_for
from ..parallel.interfaces import TensorSource
from ..weights import InitFn, initial_weights, on_meta, open_pretrained, stream_seed
from ..models import token_loss
from ..monitor import MetricsRecord, MetricsWriter, ProgressBar
from ..monitor.agreement import check_agreement
from ..monitor.callbacks import Callback, Callbacks
from ..monitor.loggers import open_loggers
from ..monitor.metrics import truncate_metrics
from ..monitor.peaks import model_flops_utilisation, resolve_peak
from ..monitor.record import (ACTIVATIONS, DEVICE_NAME, MEMORY_BYTES,
                              MEMORY_BYTES_PER_RANK, MFU, PEAK_SOURCE, PEAK_TFLOPS,
                              RANK_COMPUTE_S, RANK_DATA_S, RANK_SAMPLES)
from ..monitor.stats import StragglerDetector, StepStats
from ..monitor.telemetry import Telemetry
from ..monitor.trace import Tracer, merge_traces
from ..monitor.watchdog import HangWatchdog, default_store
from ..names import (CONFIG_FILE, METRICS_FILE, MODEL_CONFIG_FILE, NONFINITE_STOP,
                     TRACE_FILE, trace_rank_file)
from ..parallel.balance import BatchSplitter, micro_batch_sizes
from ..parallel.compose import PARAMETER_SERVER, PIPELINE, PLAIN, Groups, compose
from ..parallel.topology import Topology, build_topology
from ..run_checks import resolve
from . import rundir
from .checkpointing import RunCheckpoints, finished_run
from .final_weights import write_final_weights
from .flops import count_flops_per_term, shape_flops_per_token
from .loops import LoopResult, ParameterServerLoop, StepLoop, TrainingLoop
from .optim import build_optimizer, lr_at, set_lr
from .ownership import RunDirLock, owned_by_launcher
from .preemption import SignalStop
from .pipeline_step import PipelineStepRunner
from .precision import LossScaler, autocast
from .runtime import Runtime, init_runtime, shutdown, world_size_from_env
from .batch import Batch, LossFn, collate_samples, split_batch, to_device
from .loading import StepLoader, planned_lists
from .step import StepRunner

# the step runner and the loop each kind of step (Parallelized.step) needs
RUNNERS: dict[str, type[StepRunner]] = {PLAIN: StepRunner, PIPELINE: PipelineStepRunner,
                                        PARAMETER_SERVER: StepRunner}
LOOPS: dict[str, type] = {PLAIN: StepLoop, PIPELINE: StepLoop,
                          PARAMETER_SERVER: ParameterServerLoop}


def _as_config(config: Config | Mapping | None) -> Config:
    if config is None:
        return load_config()
    if isinstance(config, Config):
        return config
    return load_config(values=dict(config))


class Trainer:
    """Trains ``model`` on ``dataset`` with the strategies the config selects.

    The config is validated when the Trainer is made, before any process group, against
    the model's ``spec`` (default: :func:`~disttrain.spec.spec_for` the model);
    the process group (if none exists yet) is created by :meth:`fit` from the
    environment that ``disttrain run`` / torchrun set, or as a world of one.
    ``callbacks`` (:class:`~disttrain.Callback`) are called at the points of the run,
    beside the loggers ``monitor.loggers`` names (:mod:`disttrain.monitor.callbacks`).
    A model built under ``torch.device("meta")`` is never held whole: each rank gives
    storage to its own part only and fills it from the seeded initialiser
    (:mod:`disttrain.weights`), with ``init_fn`` (one module's own tensors initialised
    in place; default: the model's own, for the built-in GPT and transformers models).
    ``pretrained``: a transformers model directory whose safetensors weights the model
    starts from (each rank reads its own part; :func:`disttrain.weights.pretrained_model`
    builds the matching model on meta).
    """

    def __init__(self, model: nn.Module, dataset: Dataset, loss_fn: LossFn | None = None,
                 config: Config | Mapping | None = None, *, eval_dataset: Dataset | None = None,
                 collate_fn: Callable[[list], Any] | None = None,
                 run_dir: str | Path | None = None, flops_per_token: int | None = None,
                 progress: bool = True, spec: ModelSpec | None = None,
                 callbacks: Sequence[Callback] = (), init_fn: InitFn | None = None,
                 pretrained: str | Path | None = None) -> None:
        self.config = _as_config(config)
        self.spec = spec or spec_for(model)
        self.plan: RunPlan = resolve(self.config, world_size_from_env(), self.spec)
        # where the values come from (None: the model's own), read per rank once composed
        seeded = (initial_weights(model, self.config.train.seed, init_fn)
                  if on_meta(model) else None)
        self.weights: TensorSource | None = (
            open_pretrained(pretrained, model, rest=seeded) if pretrained else seeded)
        if collate_fn is None:  # the default collation takes a datasets.Dataset's rows
            dataset = tensor_rows(dataset)  # as tensors
            eval_dataset = None if eval_dataset is None else tensor_rows(eval_dataset)
        self.model, self.dataset, self.loss_fn = model, dataset, loss_fn
        self.eval_dataset = eval_dataset
        self.collate_fn = collate_fn or collate_samples
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.flops_per_token = flops_per_token
        self.progress = progress
        self.watchdog: HangWatchdog | None = None   # made by fit()
        self.loader: StepLoader | None = None
        self.telemetry: Telemetry | None = None
        self.user_callbacks = list(callbacks)  # see disttrain.monitor.callbacks
        self.callbacks: Callbacks | None = None  # with the config's loggers, by fit()
        self.lock: RunDirLock | None = None  # rank 0's hold on the run directory
        self.stopping = 0  # the signal every rank agreed to stop on (0: none)

    @property
    def rank(self) -> int:
        """This process's global rank (valid during and after :meth:`fit`)."""
        return self.runtime.rank

    @property
    def is_main(self) -> bool:
        return self.runtime.is_main

    # ----------------------------------------------------------------- build steps
    def fit(self) -> dict[str, Any]:
        """Train for ``train.steps`` steps; return the run summary (also written to
        ``summary.json`` in the run directory)."""
        p = self.config.parallel
        runtime = init_runtime(self.config.train.device, p.backend, p.timeout_s)
        try:
            self._build_groups(runtime)
            finished = self._finished_summary()
            if finished is not None:
                return finished
            self._build()
            self.callbacks.train_start(self)
            loop: TrainingLoop = LOOPS[self.parallel.step]()
            try:
                result = loop.run(self)
            except DivergenceError:
                self.checkpoints.close()  # a save of an earlier, finite step completes
                raise
            self.bar.close()
            self.checkpoints.close()
            self.announce_checkpoints()
            summary = self._finish(result)
            self.callbacks.train_end(self, summary)
            return summary
        finally:
            self._close()
            shutdown(runtime)

    def _build_groups(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.topology: Topology = build_topology(self.plan.layout, runtime.device.type)
        self.ledger = CollectiveLedger()
        self.world = Communicator(None, self.ledger, "world")
        self.groups = Groups(world=self.world, **{
            axis: Communicator(self.topology.group(axis), self.ledger, axis)
            for axis in ("dp", "pp", "tp")})

    def _finished_summary(self) -> dict[str, Any] | None:
        """When the run directory's run already reached ``train.steps``: rank 0 says so
        and every rank returns its stored summary ({} if none), writing nothing; else
        None. Damaged checkpoints are left for the resume to report."""
        found = None
        if self.runtime.is_main and self.run_dir is not None:
            try:
                line = finished_run(self.run_dir, self.config.train.steps,
                                    warn=lambda _: None)
            except UserError:
                line = None
            if line is not None:
                print(f"disttrain: {line}", file=sys.stderr)
                found = rundir.read_summary(self.run_dir)
        return self.world.broadcast_object(found)

    def _build(self) -> None:
        # the random streams (dropout masks) from train.seed, the same on every rank of a
        # tp group, whose replicated activations need the same masks (a resume then
        # restores the checkpoint's streams)
        torch.manual_seed(stream_seed(self.config.train.seed, self.topology.dp_rank,
                                      self.topology.coordinate("pp")))
        self._build_watchdog()
        self.tracer = Tracer(self.config.monitor.trace, self.runtime.rank)
        self.signals = SignalStop(control_beside(self.world))  # no GPU sync per step
        self._build_data()
        self._build_model()
        self._build_outputs()
        self._build_checkpoints()
        self._build_step()

    def _build_watchdog(self) -> None:
        timeout, store = self.config.monitor.hang_timeout, default_store()
        if timeout and store is not None and self.runtime.world_size > 1:
            self.watchdog = HangWatchdog(self.ledger, store, self.runtime.rank,
                                         self.runtime.world_size, timeout).start()

    def _build_model(self) -> None:
        """The composition of every strategy over the model, and its optimizer."""
        train = self.config.train
        self.total_params = sum(p.numel() for p in self.model.parameters())
        check_agreement(self.world, self.config, self.model)  # before any sized collective
        if not on_meta(self.model):  # else: only this rank's part gets storage, in compose
            self.model.to(self.runtime.device)
        self.flops_per_term = self._flops_per_term()  # on the model as the user gave it
        self.parallel = compose(self.model, self.spec, self.config, self.topology,
                                self.groups, micro_batches=self.plan.batch.grad_accum,
                                num_samples=len(self.dataset), tracer=self.tracer)
        # a head sharded over the vocabulary: the causal-LM loss on the shards, any
        # other loss on the gathered logits (never swapped for another loss)
        self.loss_fn = self.parallel.loss_for(self.loss_fn, token_loss)
        self.optimizer = build_optimizer(
            self.parallel.module, train, self.plan.lr,
            self.parallel.state.optimizer_groups(train.weight_decay), self.groups.dp)
        self.parallel.bind_optimizer(self.optimizer)
        if self.weights is not None:
            self.parallel.fill(self.weights, self.optimizer)

    def _build_data(self) -> None:
        self.sampler = GlobalOrderSampler(len(self.dataset), self.config.train.seed)
        self.ahead = GlobalOrderSampler(len(self.dataset), self.config.train.seed)
        self.loader = StepLoader(self.dataset, self.collate_fn, self.runtime.device,
                                 self.spec.call_kwargs, self.config.data.workers,
                                 in_worker=lambda: self.lock and self.lock.forget_in_child())
        self.position = 0  # global sample index of the next global batch
        b = self.plan.batch
        self.splitter = BatchSplitter(b.global_batch, b.dp,
                                      self.config.parallel.balance == "dynamic")

    def _build_outputs(self) -> None:
        main, mon = self.runtime.is_main, self.config.monitor
        chosen = self.run_dir or (rundir.new_run_dir_name() if main else None)
        self.run_dir = Path(self.world.broadcast_object(str(chosen) if chosen else None))
        self._take_ownership()
        self.bar = ProgressBar(self.config.train.steps, enabled=main, show_bar=self.progress,
                               every=self.config.train.log_every)
        peak = resolve_peak(mon.peak_tflops, self.runtime.device, self.config.train.precision)
        self.telemetry = Telemetry(
            self.world, self.runtime.device,
            MetricsWriter(self.run_dir / METRICS_FILE if main else None, self.bar.message),
            StragglerDetector(mon.straggler_threshold, mon.straggler_window), peak,
            self.bar.message)
        loggers = open_loggers(self.config, self.run_dir, self.bar.message) if main else []
        self.callbacks = Callbacks(self.user_callbacks + loggers, main, self.bar.message,
                                   self.runtime.rank)

    def _take_ownership(self) -> None:
        """Rank 0 locks the run directory unless its launcher holds it; a refusal is
        every rank's error."""
        def own() -> None:
            if not owned_by_launcher(self.run_dir):
                self.lock = RunDirLock(self.run_dir)
            self._write_config()
        self._on_main(own, f"cannot write the run directory {self.run_dir}", UserError)

    def _on_main(self, work: Callable[[], None], failed: str,
                 error: type[Exception]) -> None:
        """Rank 0 runs ``work``; a refusal it raises (its text) or an I/O failure
        (``failed``: the reason) becomes every rank's ``error``, so no rank waits in a
        collective for one that gave up."""
        problem = None
        if self.runtime.is_main:
            try:
                work()
            except UserError as exc:
                problem = str(exc)
            except OSError as exc:
                problem = f"{failed}: {exc.strerror or exc}"
        problem = self.world.broadcast_object(problem)
        if problem is not None:
            raise error(problem)

    def _write_config(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_text_atomic(self.run_dir / CONFIG_FILE,
                                 config_to_toml(self.config, self.plan))
        if self.spec.config_json is not None:
            rundir.write_text_atomic(self.run_dir / MODEL_CONFIG_FILE, self.spec.config_json)

    def _build_checkpoints(self) -> None:
        self.checkpoints = RunCheckpoints(self.run_dir, self.config, self.plan, self.world,
                                          self.parallel.state, self.optimizer,
                                          self.parallel.local_boxes(self.optimizer))
        self.start_step = 0
        resumed = self.checkpoints.resume(say=self.bar.message)
        if resumed is not None:
            self.start_step, self.position = resumed
            self.parallel.sync.restart()  # e.g. DiLoCo's round starts from these weights
            if self.runtime.is_main:  # records past the checkpoint are redone
                try:
                    truncate_metrics(self.run_dir / METRICS_FILE, self.start_step)
                except OSError as exc:
                    self.bar.message(f"warning: could not drop the metrics records past "
                                     f"step {self.start_step}: {exc.strerror or exc}")

    def _build_step(self) -> None:
        train = self.config.train
        self.stepper = RUNNERS[self.parallel.step].from_parallel(
            self.parallel, ledger=self.ledger, optimizer=self.optimizer,
            loss_fn=self.loss_fn, load=self.loader.load, grad_clip=train.grad_clip,
            device=self.runtime.device, tracer=self.tracer, rank=self.runtime.rank,
            precision=train.precision, scaler=LossScaler(train.precision == "fp16"),
            before_update=self.checkpoints.before_update,
            token_loss=self.parallel.token_loss)
        self.step_bytes = self.logged_bytes = 0  # ledger payload of steps and syncs
        self.step_wire = self.logged_wire = 0  # and the wire bytes this rank sent

    def _flops_per_term(self) -> float:
        """Training FLOPs per loss term: given, or from the spec, else counted on the
        first micro-batch of the sample order, on a pass apart from training (see
        :mod:`.flops`)."""
        known = self.flops_per_token or self.spec.flops_per_token
        if known:
            return known
        batch = self._load(self.sampler.indices(0, self.plan.batch.micro_batch))
        if on_meta(self.model):  # no values to run: from the shapes, where known
            return shape_flops_per_token(self.model, batch)
        return count_flops_per_term(self.model, batch, self.loss_fn,
                                    self.config.train.precision, self.runtime.device)

    # ----------------------------------------------------------------- one step
    def train_step(self, step: int) -> StepStats:
        """One optimizer step on this rank's share of the global batch (0-based
        ``step``), then the sync mode's between-steps work."""
        lr = lr_at(step, self.config.train, self.plan.lr)
        set_lr(self.optimizer, lr)
        self.current_lr = lr
        sent, wire0 = self.ledger.payload_bytes, self.ledger.wire_sent_bytes
        rank = self.topology.dp_rank
        share = self.splitter.shares[rank]
        indices = self.sampler.indices(self.position + self.splitter.offsets()[rank], share)
        selected = self.parallel.sync.select(step, indices)
        lists = [] if selected is None else self._micro_batches(selected)
        self.loader.follow(lists, planned_lists(
            self.ahead, self.position, self.splitter.offsets()[rank], share,
            self.plan.batch.global_batch, self._micro_batches))
        with self.tracer.span("step", step=step + 1):
            # a fedavg client sitting this round out does not step
            stats = StepStats() if selected is None else self.stepper.run(lists)
        bad = None if selected is None else self.stepper.nonfinite
        if self.parallel.sync.steps_apart and self._stops_on_nonfinite:
            bad = self._any_rank_nonfinite(bad)  # every rank stops at the same step
        if bad is not None:
            self._on_nonfinite(step + 1, bad)
        if self.stepper.terms_are_samples:
            self.bar.unit = "samples"
        self.position += self.plan.batch.global_batch
        done = step + 1
        self.parallel.sync.after_step(done, last=done == self.config.train.steps)
        self.step_bytes += self.ledger.payload_bytes - sent
        self.step_wire += self.ledger.wire_sent_bytes - wire0
        self.telemetry.window.add(stats)
        self.bar.update(done, stats.loss, stats.terms, stats.total_s, lr=lr)
        self.callbacks.step_end(self, MetricsRecord(
            step=done, lr=lr, loss=stats.loss if stats.terms else None,
            grad_norm=self.stepper.grad_norm, samples_seen=self.position))
        return stats

    @property
    def _stops_on_nonfinite(self) -> bool:
        return self.config.train.on_nonfinite == NONFINITE_STOP

    def _any_rank_nonfinite(self, mine: str | None) -> str | None:
        """What went non-finite on any rank (replicas that step apart share no loss
        total): one all-reduce of two flags, loss and gradients."""
        flags = self.world.zeros(2)
        flags[0] = float(mine is not None and "loss" in mine)
        flags[1] = float(mine is not None and "gradients" in mine)
        self.world.all_reduce(flags, op=ReduceOp.MAX)
        loss, grads = flags.tolist()
        return ("loss and gradients" if loss and grads else "loss" if loss
                else "gradients" if grads else None)

    def _on_nonfinite(self, done: int, what: str) -> None:
        """Step ``done`` computed a nan / inf ``what`` (its update was not applied; every
        rank agrees, except that under skip replicas that step apart skip on their
        own): stop the run, or go on without it."""
        if self._stops_on_nonfinite:
            raise DivergenceError(done, what)
        self.bar.message(f"step {done}: the {what} went non-finite; update skipped "
                         f"({self.stepper.nonfinite_skipped} skipped so far)")

    def _micro_batches(self, indices: list[int]) -> list[list[int]]:
        """This rank's indices as the step's micro-batches: the same count on every
        rank (enough for the largest share), each at most ``micro_batch`` samples."""
        size = self.plan.batch.micro_batch
        sizes = micro_batch_sizes(len(indices), size, self.splitter.micro_batches(size))
        out, start = [], 0
        for n in sizes:
            out.append(indices[start:start + n])
            start += n
        return out

    def maybe_checkpoint(self, done: int) -> None:
        """Save after step ``done`` if it is due and the replicas agree (first, collect
        a finished asynchronous save: a failed one stops training here)."""
        self.checkpoints.check()
        if self.checkpoints.due(done) and self.parallel.sync.at_boundary(done):
            with self.tracer.span("checkpoint"):
                self.checkpoints.save(done, self.position)
        self.announce_checkpoints()

    def announce_checkpoints(self) -> None:
        """Tell the callbacks of each checkpoint committed since the last call (an
        asynchronous save: once every rank's part is written)."""
        for step in self.checkpoints.take_completed():
            self.callbacks.checkpoint(self, step, self.checkpoints.directory(step))

    def stop_if_signalled(self, done: int) -> None:
        """After step ``done``: if any rank got SIGTERM / SIGINT, save (unless
        ``checkpoint.on_signal=exit``) at the first step where a save is valid, then
        raise :class:`~disttrain.errors.Interrupted` on every rank."""
        self.stopping = self.stopping or self.signals.agreed()
        save = self.config.checkpoint.on_signal == "save"
        if not self.stopping or (save and not self.parallel.sync.at_boundary(done)):
            return
        if save and self.checkpoints.last_saved != done:
            with self.tracer.span("checkpoint"):
                self.checkpoints.save(done, self.position)
        self.checkpoints.close()  # an async save is complete before the exit
        what = "checkpoint saved" if save else "not saved (checkpoint.on_signal=exit)"
        name = signal.Signals(self.stopping).name
        self.announce_checkpoints()
        self.bar.message(f"stopped by {name} after step {done}; {what}")
        raise Interrupted(self.stopping)

    def _load(self, indices: list[int]) -> Batch:
        batch = self.collate_fn(fetch_samples(self.dataset, indices))
        return split_batch(to_device(batch, self.runtime.device), self.spec.call_kwargs)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean held-out loss over ``train.eval_samples`` samples, split across dp ranks;
        one all-reduce at the end, so uneven shares never desynchronise ranks."""
        if self.eval_dataset is None:
            return None
        self.model.eval()
        indices = eval_indices(len(self.eval_dataset), self.config.train.eval_samples,
                               self.groups.dp.rank, self.groups.dp.size)
        totals = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        size = self.plan.batch.micro_batch
        for start in range(0, len(indices), size):
            chunk = indices[start:start + size]
            batch = self.collate_fn(fetch_samples(self.eval_dataset, chunk))
            with autocast(self.config.train.precision, self.runtime.device):
                loss_sum, count = self.stepper.eval_totals(
                    split_batch(to_device(batch, self.runtime.device),
                                self.spec.call_kwargs))
            totals[0] += loss_sum
            totals[1] += count
        self.stepper.reduce_eval(totals)
        self.model.train()
        return float(totals[0] / totals[1].clamp(min=1))

    # ----------------------------------------------------------------- outputs
    def banner(self, initial_eval: float | None) -> str:
        lay, b = self.plan.layout, self.plan.batch
        text = (f"disttrain: {self.runtime.world_size} rank(s) on "
                f"{self.runtime.device.type}/{self.runtime.backend}, dp={lay.dp}; "
                f"global batch {b.global_batch} = {b.micro_batch} x {b.grad_accum} x "
                f"{b.dp}; {self.total_params:,} parameters; run dir {self.run_dir}")
        text += self._layout_lines()
        if initial_eval is not None:
            text += f"\ninitial held-out loss {initial_eval:.4f}"
        return text

    def _layout_lines(self) -> str:
        """Which ranks hold which layers and shards (pp or tp > 1), gathered from all."""
        lay = self.plan.layout
        if lay.pp == 1 and lay.tp == 1:
            return ""
        g = self.groups
        mine = (f"rank {self.runtime.rank} (pp {g.pp.rank}, dp {g.dp.rank}, tp "
                f"{g.tp.rank}): {self.parallel.describe()}")
        par = self.config.parallel
        head = (f"\nlayout pp={lay.pp} x dp={lay.dp} x tp={lay.tp}"
                + (f", schedule {par.pp_schedule} with {self.plan.batch.grad_accum} "
                   f"micro-batches" if lay.pp > 1 else ""))
        return head + "".join(f"\n  {line}" for line in self.world.all_gather_object(mine))

    def log(self, step: int, eval_loss: float | None) -> None:
        """A metrics record for step ``step`` (a collective: every rank calls it)."""
        window, scaler = self.telemetry.window, self.stepper.scaler
        record = MetricsRecord(
            step=step, lr=self.current_lr, grad_norm=self.stepper.grad_norm,
            samples_per_s=window.samples_per_s(self.plan.batch.global_batch),
            samples_seen=self.position, shares=list(self.splitter.shares),
            checkpoint_stall_s=self.checkpoints.stall_s,
            loss_scale=scaler.scale if scaler.enabled else None,
            skipped_steps=scaler.skipped if scaler.enabled else None,
            nonfinite_skipped=self.stepper.nonfinite_skipped or None,
            eval_loss=eval_loss,
            memory_mb={k: v / 2**20 for k, v in self._memory().items()},
            comm_bytes_per_step=(self.step_bytes - self.logged_bytes) / max(window.steps, 1),
            comm_wire_bytes_per_step=(self.step_wire - self.logged_wire)
            / max(window.steps, 1),
        ).with_figures({**self.parallel.sync.metrics(),
                        **self.parallel.grads.comm_stats()})  # bytes sent, compression ratio
        self.logged_bytes, self.logged_wire = self.step_bytes, self.step_wire
        record, ranks = self.telemetry.log(record, self.flops_per_term)
        self.callbacks.log(self, record)
        self.splitter.update([r[RANK_SAMPLES] for r in ranks],
                             [r[RANK_COMPUTE_S] + r[RANK_DATA_S] for r in ranks],
                             self.plan.batch.micro_batch)

    def _finish(self, result: LoopResult) -> dict[str, Any]:
        lay = self.plan.layout
        summary = {
            "steps": self.config.train.steps, "start_step": self.start_step,
            "world_size": self.runtime.world_size,
            "layout": {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "zero": lay.zero},
            "global_batch": self.plan.batch.global_batch,
            "final_train_loss": result.final_loss,
            "initial_eval_loss": result.initial_eval, "final_eval_loss": result.final_eval,
            "wall_time_s": result.wall_time, "train_time_s": result.totals.wall_s,
            "busy_time_s": result.totals.busy_s(),
            "comm_wait_s": result.totals.sum.comm_s, "data_time_s": result.totals.sum.data_s,
            "tokens_per_s": result.totals.terms_per_s(),
            "samples_seen": self.position, "run_dir": str(self.run_dir),
            "parameters": self.total_params,
            "comm_bytes_per_step": self.step_bytes / max(self.config.train.steps
                                                         - self.start_step, 1),
            "comm_wire_bytes_per_step": self.step_wire / max(self.config.train.steps
                                                             - self.start_step, 1),
            "collectives": self.ledger.seq,
            "nonfinite_skipped": self.stepper.nonfinite_skipped,
        }
        if self.flops_per_term:
            peak = self.telemetry.peak
            summary["model_flops_per_s"] = summary["tokens_per_s"] * self.flops_per_term
            summary[MFU] = model_flops_utilisation(summary["tokens_per_s"],
                                                   self.flops_per_term, peak.flops,
                                                   self.runtime.world_size)
            summary |= {PEAK_TFLOPS: peak.flops / 1e12, PEAK_SOURCE: peak.source}
        summary[MEMORY_BYTES] = self._memory()
        # one gather at the end: pipeline stages and tp shards hold different amounts
        summary[MEMORY_BYTES_PER_RANK] = self.world.all_gather_object(summary[MEMORY_BYTES])
        summary[DEVICE_NAME] = _device_name(self.runtime.device)
        summary |= self.parallel.sync.metrics()
        # the final weights from every rank's pieces, one tensor at a time on rank 0
        problem = write_final_weights(self.parallel.weight_pieces(self.optimizer),
                                      self.world, self.run_dir)
        if problem is not None:
            raise CheckpointSaveError(f"could not write the final weights: {problem}")
        self.parallel.grads.finalize()  # a model built whole keeps its full parameters
        self._on_main(lambda: rundir.write_summary(self.run_dir, summary),
                      f"could not write the summary in {self.run_dir}", CheckpointSaveError)
        if self.runtime.is_main:
            self.bar.message(_summary_text(summary, self.bar.unit))
        self._write_trace()
        return summary

    def _memory(self) -> dict[str, int]:
        """This rank's model state, and the most activation bytes it saved for backward
        (one micro-batch's forward; a pipeline stage's peak over its schedule)."""
        return {**self.parallel.grads.model_state_bytes(self.optimizer),
                ACTIVATIONS: self.stepper.activation_bytes or 0}

    def _write_trace(self) -> None:
        """Each rank writes its spans; rank 0 merges them into ``trace.json``."""
        if self.tracer.enabled:
            self.tracer.write(self.run_dir / trace_rank_file(self.runtime.rank))
        self.world.barrier()
        if self.tracer.enabled and self.runtime.is_main:
            parts = [self.run_dir / trace_rank_file(r)
                     for r in range(self.runtime.world_size)]
            merge_traces(parts, self.run_dir / TRACE_FILE)

    def _close(self) -> None:
        """Stop the watchdog, the loader workers and the writers, whatever stage the run
        reached."""
        if self.loader is not None:
            self.loader.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.telemetry is not None:
            self.telemetry.close()
        if self.callbacks is not None:  # after an error or a signal: no summary
            self.callbacks.train_end(self, None)
        if self.lock is not None:
            self.lock.release()


def _device_name(device: torch.device) -> str:
    """``cpu``, or the GPU's name as torch gives it (``NVIDIA H100 80GB HBM3``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _summary_text(s: dict[str, Any], unit: str) -> str:
    ev = ("" if s["final_eval_loss"] is None else
          f"held-out loss {s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}; ")
    ran = s["steps"] - s["start_step"]
    which = (f"steps {s['start_step'] + 1}-{s['steps']} of {s['steps']}" if s["start_step"]
             else f"{ran} steps")
    return (f"done: {which} in {s['wall_time_s']:.1f}s on {s['world_size']} "
            f"rank(s); train loss {s['final_train_loss']:.4f}; {ev}"
            f"{s['tokens_per_s']:,.0f} {unit}/s; run dir {s['run_dir']}")
