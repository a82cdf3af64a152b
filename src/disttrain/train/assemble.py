"""A run put together, part by part, each built whole and then only used.

:func:`assemble_run` is what :meth:`~disttrain.Trainer.fit` calls once the process group
exists: the random streams, the hang watchdog, the data cursor, the composed model and
its optimizer (filled from its weights' source), the run directory and reporting, the
checkpoints (a resume), the step. Whatever needs closing is pushed on ``closing`` as
soon as it exists, so an error at any point closes what was built.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sized
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from ..comm import CollectiveLedger, Communicator, control_beside
from ..config import Config, RunPlan
from ..dimensions import DIMENSIONS, Role
from ..errors import UserError
from ..models import token_loss
from ..monitor import MetricsWriter, ProgressBar
from ..monitor.agreement import check_agreement
from ..monitor.callbacks import Callback, Callbacks
from ..monitor.callbacks import Trainer as CallbackSubject
from ..monitor.loggers import open_loggers
from ..monitor.metrics import truncate_metrics
from ..monitor.peaks import resolve_peak
from ..monitor.stats import StragglerDetector
from ..monitor.telemetry import Telemetry
from ..monitor.trace import Tracer
from ..monitor.watchdog import HangWatchdog, default_store
from ..names import METRICS_FILE, NONFINITE_STOP
from ..parallel.compose import Groups, compose
from ..parallel.ft.check import FT_REPLICA
from ..parallel.ft.replicas import ReplicaGroups, build_replica_groups
from ..parallel.interfaces import TensorSource
from ..parallel.pieces import fill, local_boxes
from ..parallel.topology import Topology, build_topology
from ..spec import ModelSpec
from ..weights import on_meta, stream_seed
from . import rundir
from .batch import BatchLoss, LossFn
from .cadence import CheckpointCadence
from .checkpointing import RunCheckpoints, finished_run
from .cursor import DataCursor
from .flops import count_flops_per_token, shape_flops_per_token
from .frozen import frozen_fingerprint
from .loading import StepLoader
from .nonfinite import NonFinitePolicy
from .outputs import RunDirectory
from .precision import LossScaler
from .preemption import SignalStop
from .report import RunReporter
from .run import CommTally, EvalData, Run, RunModel, StepFacts
from .runtime import Runtime
from .step import FigureCopies


@dataclass(frozen=True, kw_only=True)
class RunInputs:
    """What the user handed the Trainer, checked: the model, data, loss, config and the
    plan validated from it, where the weights come from (None: the model's own)."""

    model: nn.Module
    dataset: Dataset
    eval_dataset: Dataset | None
    loss_fn: LossFn | None
    collate_fn: Any
    config: Config
    plan: RunPlan
    spec: ModelSpec
    weights: TensorSource | None
    flops_per_token: float | None
    progress: bool
    callbacks: list[Callback]


@dataclass(frozen=True)
class Mesh:
    """The process groups of a run: its topology, the world and one per mesh axis."""

    topology: Topology
    ledger: CollectiveLedger
    groups: Groups

    @property
    def world(self) -> Communicator:
        return self.groups.world


def build_mesh(inputs: RunInputs, runtime: Runtime) -> Mesh:
    topology = build_topology(inputs.plan.layout, runtime.device.type)
    ledger = CollectiveLedger()
    return Mesh(topology, ledger, Groups.build(topology, ledger))


def finished_summary(inputs: RunInputs, mesh: Mesh, run_dir: Path | None
                     ) -> dict[str, Any] | None:
    """When the run directory's run already reached ``train.steps``: rank 0 says so
    and every rank returns its stored summary ({} if none), writing nothing; else
    None. Damaged checkpoints are left for the resume to report."""
    found = None
    if mesh.world.rank == 0 and run_dir is not None:
        try:
            line = finished_run(run_dir, inputs.config.train.steps, warn=lambda _: None)
        except UserError:
            line = None
        if line is not None:
            print(f"disttrain: {line}", file=sys.stderr)
            found = rundir.read_summary(run_dir)
    return cast("dict[str, Any] | None", mesh.world.broadcast_object(found))


def assemble_run(inputs: RunInputs, runtime: Runtime, mesh: Mesh, directory: RunDirectory,
                 subject: CallbackSubject, closing: ExitStack) -> Run:
    """Every part of the run on this rank (see the module docstring)."""
    config, plan, world = inputs.config, inputs.plan, mesh.world
    # the random streams (dropout masks) from train.seed, keyed by this rank's
    # coordinate on the axes whose ranks draw their own (the same on every rank of a tp
    # group, whose replicated activations need the same masks; a resume then restores
    # the checkpoint's streams)
    torch.manual_seed(stream_seed(config.train.seed, [
        (d.axis, mesh.topology.coordinate(d.axis)) for d in DIMENSIONS if d.own_streams]))
    _start_watchdog(config, runtime, mesh, closing)
    tracer = Tracer(config.monitor.trace, runtime.rank)
    signals = SignalStop(control_beside(world))  # no GPU sync per step
    loader = StepLoader(inputs.dataset, inputs.collate_fn, runtime.device,
                        inputs.spec.call_kwargs, config.data.workers,
                        in_worker=directory.forget_in_child)
    closing.callback(loader.close)
    cursor = DataCursor(_num_samples(inputs.dataset), config.train.seed, plan.batch,
                        mesh.topology.role_index(Role.SAMPLES),
                        config.parallel.balance == "dynamic", loader)
    model, loss_fn = _build_model(inputs, runtime, mesh, cursor, tracer)
    run_dir = directory.claim(world, config, plan, inputs.spec.config_json)
    closing.callback(directory.release)
    reporter = _build_reporter(inputs, runtime, world, run_dir, subject)
    closing.callback(reporter.close)
    # the model gives logits again however the run ends (before on_train_end on an error)
    closing.callback(model.parallel.restore_head)
    checkpoints = RunCheckpoints(run_dir, config, plan, world, model.parallel.state,
                                 model.optimizer,
                                 local_boxes(model.parallel, model.optimizer),
                                 frozen_fingerprint(model.parallel, model.optimizer, world))
    start_step = _resume(checkpoints, cursor, model, reporter, run_dir, runtime)
    train = config.train
    sync = model.parallel.sync
    facts = StepFacts()
    join_replicas: Callable[[], ReplicaGroups] | None = None
    if config.parallel.fault_tolerance == FT_REPLICA:
        def join() -> ReplicaGroups:
            replicas = build_replica_groups(
                config, module=model.parallel.module, optimizer=model.optimizer,
                cursor=cursor, losses=facts.recent_losses, ledger=mesh.ledger, world=world,
                group_rank=runtime.rank, group_size=runtime.world_size,
                device=runtime.device, start_step=start_step)
            closing.callback(replicas.close)
            return replicas
        join_replicas = join
    return Run(
        config=config, plan=plan, runtime=runtime, world=world, model=model, cursor=cursor,
        load=loader.load, loss=BatchLoss(loss_fn, model.parallel.token_loss),
        scaler=LossScaler(train.precision == "fp16", runtime.device),
        figures=FigureCopies(runtime.device), reporter=reporter, checkpoints=checkpoints,
        cadence=CheckpointCadence(checkpoints, signals, sync, tracer,
                                  config.checkpoint.on_signal == "save", reporter.checkpoint,
                                  reporter.say),
        nonfinite=NonFinitePolicy(train.on_nonfinite == NONFINITE_STOP, sync.steps_apart,
                                  world, reporter.say),
        signals=signals, tracer=tracer,
        evaluation=EvalData(dataset=inputs.eval_dataset, collate=inputs.collate_fn,
                            call_kwargs=inputs.spec.call_kwargs),
        run_dir=run_dir, start_step=start_step, tally=CommTally(mesh.ledger),
        facts=facts, join_replicas=join_replicas)


def _num_samples(dataset: Dataset) -> int:
    """The length of a map-style dataset (the trainer's; torch's ``Dataset`` declares
    no ``__len__``, the ones a trainer takes have one)."""
    return len(cast(Sized, dataset))


def _start_watchdog(config: Config, runtime: Runtime, mesh: Mesh, closing: ExitStack
                    ) -> None:
    timeout, store = config.monitor.hang_timeout, default_store()
    if timeout and store is not None and runtime.world_size > 1:
        watchdog = HangWatchdog(mesh.ledger, store, runtime.rank, runtime.world_size,
                                timeout).start()
        closing.callback(watchdog.stop)


def _build_model(inputs: RunInputs, runtime: Runtime, mesh: Mesh, cursor: DataCursor,
                 tracer: Tracer) -> tuple[RunModel, LossFn | None]:
    """The composition of every strategy over the model, its optimizer, and the loss a
    step calls."""
    model, config = inputs.model, inputs.config
    parameters = sum(p.numel() for p in model.parameters())
    check_agreement(mesh.world, config, model)  # before any sized collective
    if not on_meta(model):  # else: only this rank's part gets storage, in compose
        model.to(runtime.device)
    flops = _flops_per_token(inputs, runtime, cursor)  # on the model as the user gave it
    parallel = compose(model, inputs.spec, config, mesh.topology, mesh.groups,
                       micro_batches=inputs.plan.batch.grad_accum,
                       num_samples=_num_samples(inputs.dataset), tracer=tracer,
                       default_loss=inputs.loss_fn is None or inputs.loss_fn is token_loss)
    # the output head fused into the loss, or sharded over the vocabulary: the
    # causal-LM loss computed by the composition's token loss, any other loss on the
    # full logits (never swapped for another loss)
    loss_fn = parallel.loss_for(inputs.loss_fn, token_loss)
    optimizer = parallel.build_optimizer(config, inputs.plan.lr)
    if inputs.weights is not None:
        fill(parallel, inputs.weights, optimizer)
    return RunModel(parallel=parallel, optimizer=optimizer, parameters=parameters,
                    flops_per_token=flops), loss_fn


def _flops_per_token(inputs: RunInputs, runtime: Runtime, cursor: DataCursor) -> float:
    """Training FLOPs per token (per position the loss runs over): given, or from the
    spec, else counted on the first micro-batch of the sample order, on a pass apart
    from training (see :mod:`.flops`)."""
    known = inputs.flops_per_token or inputs.spec.flops_per_token
    if known:
        return known
    batch = cursor.loader.load(cursor.first_micro_batch())  # before any plan: loaded here
    if on_meta(inputs.model):  # no values to run: from the shapes, where known
        return shape_flops_per_token(inputs.model, batch)
    return count_flops_per_token(inputs.model, batch, inputs.loss_fn,
                                inputs.config.train.precision, runtime.device)


def _build_reporter(inputs: RunInputs, runtime: Runtime, world: Communicator,
                    run_dir: Path, subject: CallbackSubject) -> RunReporter:
    config, main = inputs.config, runtime.is_main
    mon = config.monitor
    bar = ProgressBar(config.train.steps, enabled=main, show_bar=inputs.progress,
                      every=config.train.log_every)
    peak = resolve_peak(mon.peak_tflops, runtime.device, config.train.precision)
    telemetry = Telemetry(
        world, runtime.device,
        MetricsWriter(run_dir / METRICS_FILE if main else None, bar.message),
        StragglerDetector(mon.straggler_threshold, mon.straggler_window), peak, bar.message)
    loggers = open_loggers(config, run_dir, bar.message) if main else []
    callbacks = Callbacks(inputs.callbacks + loggers, main, bar.message, runtime.rank)
    return RunReporter(subject, bar, telemetry, callbacks)


def _resume(checkpoints: RunCheckpoints, cursor: DataCursor, model: RunModel,
            reporter: RunReporter, run_dir: Path, runtime: Runtime) -> int:
    """The step to start from: a checkpoint's (its sample position and weights
    restored), else 0."""
    resumed = checkpoints.resume(say=reporter.say)
    if resumed is None:
        return 0
    start_step, cursor.position = resumed
    model.parallel.sync.restart()  # e.g. DiLoCo's round starts from these weights
    if runtime.is_main:  # records past the checkpoint are redone
        try:
            truncate_metrics(run_dir / METRICS_FILE, start_step)
        except OSError as exc:
            reporter.say(f"warning: could not drop the metrics records past "
                         f"step {start_step}: {exc.strerror or exc}")
    return start_step
