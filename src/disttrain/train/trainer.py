"""The training loop: any ``nn.Module``, any map-style dataset, one loss function.

    trainer = disttrain.Trainer(model, dataset, loss_fn, {"train": {"steps": 100}})
    summary = trainer.fit()

A batch is what ``collate_fn`` makes of a list of samples: a pair ``(inputs, targets)``
or a mapping with ``input_ids`` and ``targets``. The model is called as
``model(inputs)``; ``loss_fn(outputs, targets)`` returns either the mean loss over the
micro-batch's samples or a pair ``(summed loss, number of loss terms)`` (e.g. target
tokens). Gradients are normalised by the global number of loss terms in the step, so
the update is the same on any number of ranks and with any accumulation split.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ..comm import CollectiveLedger, Communicator
from ..comm.codecs import build_codec
from ..config import Config, RunPlan, load_config, resolve
from ..config.dump import config_to_toml
from ..config.validate import pipeline_starts
from ..data.sampler import GlobalOrderSampler, eval_indices
from ..faults import maybe_fail
from ..monitor import MetricsWriter, ProgressBar
from ..monitor.agreement import check_agreement
from ..monitor.metrics import truncate_metrics
from ..monitor.stats import StatsWindow, StepStats, StragglerDetector, measure_peak_flops
from ..monitor.telemetry import Telemetry, TensorBoardWriter
from ..monitor.trace import Tracer, merge_traces
from ..monitor.watchdog import HangWatchdog, default_store
from ..parallel.activation import apply_activation_checkpointing, canonical_name
from ..parallel.balance import BatchSplitter
from ..parallel.data import apply_data_parallel
from ..parallel.hybrid import ModelParallel, apply_model_parallel
from ..parallel.sync import LocalGradients, SyncStrategy, build_sync
from ..parallel.zero import apply_zero
from ..topology import Topology, build_topology
from . import rundir
from .checkpointing import RunCheckpoints
from .model_parallel import (ModelParallelGrads, PipelineStepRunner, gather_full_state,
                             pipeline_eval_totals)
from .optim import build_optimizer, lr_at, set_lr
from .precision import DTYPES, LossScaler, autocast
from .runtime import Runtime, init_runtime, shutdown, world_size_from_env
from .step import LossFn, StepRunner, loss_sum_and_terms, split_batch, to_device


def _as_config(config: Config | Mapping | None) -> Config:
    if config is None:
        return load_config()
    if isinstance(config, Config):
        return config
    return load_config(values=dict(config))


class Trainer:
    """Trains ``model`` on ``dataset`` with the strategies the config selects.

    The config is validated when the Trainer is made, before any process group; the
    process group (if none exists yet) is created by :meth:`fit` from the environment
    that ``disttrain run`` / torchrun set, or as a world of one.
    """

    def __init__(self, model: nn.Module, dataset: Dataset, loss_fn: LossFn,
                 config: Config | Mapping | None = None, *, eval_dataset: Dataset | None = None,
                 collate_fn: Callable[[list], Any] | None = None,
                 run_dir: str | Path | None = None, flops_per_token: int | None = None,
                 progress: bool = True) -> None:
        self.config = _as_config(config)
        self.plan: RunPlan = resolve(self.config, world_size_from_env())
        self.model, self.dataset, self.loss_fn = model, dataset, loss_fn
        self.eval_dataset = eval_dataset
        self.collate_fn = collate_fn or default_collate
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.flops_per_token = flops_per_token
        self.progress = progress

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
            self._build(runtime)
            return self._run()
        finally:
            self._close()
            shutdown(runtime)

    def _build(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.topology: Topology = build_topology(self.plan.layout, runtime.device.type)
        self.ledger = CollectiveLedger()
        self.world = Communicator(None, self.ledger, "world")
        self.dp_comm = Communicator(self.topology.group("dp"), self.ledger, "dp")
        self.pp_comm = Communicator(self.topology.group("pp"), self.ledger, "pp")
        self.tp_comm = Communicator(self.topology.group("tp"), self.ledger, "tp")
        self._build_watchdog()
        self.tracer = Tracer(self.config.monitor.trace, runtime.rank)
        self._build_model()
        self._build_data()
        self._build_outputs()
        self._build_checkpoints()
        self._build_step()

    def _build_watchdog(self) -> None:
        timeout, store = self.config.monitor.hang_timeout, default_store()
        self.watchdog = None
        if timeout and store is not None and self.runtime.world_size > 1:
            self.watchdog = HangWatchdog(self.ledger, store, self.runtime.rank,
                                         self.runtime.world_size, timeout).start()

    def _build_model(self) -> None:
        train, par = self.config.train, self.config.parallel
        self.total_params = sum(p.numel() for p in self.model.parameters())
        check_agreement(self.world, self.config, self.model)  # before any sized collective
        self.model.to(self.runtime.device)
        self.mp = self._build_model_parallel()
        local = self.mp.module if self.mp is not None else self.model
        if self.plan.layout.zero:
            names = (self.mp.names if self.mp is not None else
                     {id(p): canonical_name(n) for n, p in local.named_parameters()})
            wire = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
                self.config.comm.codec, DTYPES[par.grad_reduce_dtype])
            self.dp = apply_zero(local, self.dp_comm, self.plan.layout.zero, names, wire)
            groups = self.dp.param_groups(train.weight_decay)
        elif train.sync != "every_step":  # replicas reconciled by self.sync, not per step
            self.dp, groups = LocalGradients(self.model, self.dp_comm), None
        else:
            self.dp = apply_data_parallel(
                local, self.dp_comm, bucket_mb=par.bucket_mb, tracer=self.tracer,
                reduce_dtype=DTYPES[par.grad_reduce_dtype],
                codec=build_codec(self.config.comm, train.seed))
            groups = None
        self.optimizer = build_optimizer(local, train, self.plan.lr, groups)
        if self.mp is not None:
            self.dp = ModelParallelGrads(self.dp, self.mp, self.world)

    def _build_model_parallel(self) -> ModelParallel | None:
        """Tensor and pipeline parallelism (the GPT only), or None when pp = tp = 1."""
        lay, par, train = self.plan.layout, self.config.parallel, self.config.train
        checkpointing = (train.activation_checkpointing, train.activation_checkpointing_k)
        if lay.pp == 1 and lay.tp == 1:
            apply_activation_checkpointing(self.model, *checkpointing)
            return None
        v = par.pp_virtual if par.pp_schedule == "interleaved" else 1
        mp = apply_model_parallel(
            self.model, self.topology, par, self.pp_comm, self.tp_comm,
            micro_batches=self.plan.batch.grad_accum, checkpointing=checkpointing,
            starts=pipeline_starts(par.pp_split, lay.pp * v, self.config.model.n_layer))
        if mp.tp is not None:  # local logits: the vocab-parallel loss
            self.loss_fn = mp.tp.loss_fn
        return mp

    def _build_data(self) -> None:
        self.sampler = GlobalOrderSampler(len(self.dataset), self.config.train.seed)
        self.position = 0  # global sample index of the next global batch
        b = self.plan.batch
        self.splitter = BatchSplitter(b.global_batch, b.dp,
                                      self.config.parallel.balance == "dynamic")

    def _build_outputs(self) -> None:
        main, mon = self.runtime.is_main, self.config.monitor
        chosen = self.run_dir or (rundir.new_run_dir_name() if main else None)
        self.run_dir = Path(self.world.broadcast_object(str(chosen) if chosen else None))
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            rundir.write_text_atomic(self.run_dir / rundir.CONFIG_FILE,
                                     config_to_toml(self.config, self.plan))
        self.bar = ProgressBar(self.config.train.steps, enabled=main, show_bar=self.progress,
                               every=self.config.train.log_every)
        peak = (mon.peak_tflops * 1e12 if mon.peak_tflops
                else measure_peak_flops(self.runtime.device))
        self.telemetry = Telemetry(
            self.world, self.runtime.device,
            MetricsWriter(self.run_dir / rundir.METRICS_FILE if main else None),
            TensorBoardWriter(str(self.run_dir / "tensorboard")
                              if main and mon.tensorboard else None),
            StragglerDetector(mon.straggler_threshold, mon.straggler_window), peak,
            self.bar.message)

    def _build_checkpoints(self) -> None:
        self.checkpoints = RunCheckpoints(
            self.run_dir, self.config, self.plan, self.world, self.model, self.optimizer,
            self.dp if self.plan.layout.zero else None, self.mp, self.topology.dp_rank)
        self.start_step = 0
        resumed = self.checkpoints.resume(say=self.bar.message)
        if resumed is not None:
            self.start_step, self.position = resumed
            if self.runtime.is_main:  # records past the checkpoint are redone
                truncate_metrics(self.run_dir / rundir.METRICS_FILE, self.start_step)

    def _build_step(self) -> None:
        pipelined = self.mp is not None and bool(self.mp.chunks)
        extra = ({"mp": self.mp, "world": self.world, "d_model": self.config.model.d_model}
                 if pipelined else {})
        self.stepper = (PipelineStepRunner if pipelined else StepRunner)(
            model=self.model, dp=self.dp, comm=self.dp_comm, optimizer=self.optimizer,
            loss_fn=self.loss_fn, load=self._load, grad_clip=self.config.train.grad_clip,
            device=self.runtime.device, tracer=self.tracer, rank=self.runtime.rank,
            precision=self.config.train.precision,
            scaler=LossScaler(self.config.train.precision == "fp16"),
            count_flops=self.flops_per_token is None, flops_per_term=self.flops_per_token,
            local=self.config.train.sync != "every_step",
            before_update=self.checkpoints.before_update, **extra)
        train = self.config.train
        self.sync: SyncStrategy = build_sync(
            train, self.model, self.dp_comm, len(self.dataset),
            build_codec(self.config.comm, train.seed)
            if train.sync in ("local_sgd", "diloco") else None)
        self.step_bytes = self.logged_bytes = 0  # ledger payload of steps and syncs

    # ----------------------------------------------------------------- the loop
    def _run(self) -> dict[str, Any]:
        train = self.config.train
        if train.sync == "async":
            return self._run_async()
        start = time.perf_counter()
        initial_eval = self.evaluate()
        self.bar.message(self._banner(initial_eval))
        totals = StatsWindow()
        recent: deque[float] = deque(maxlen=10)
        last_eval = initial_eval
        for step in range(self.start_step, train.steps):
            sent = self.ledger.payload_bytes
            stats = self._train_step(step)
            self.sync.after_step(step + 1, last=step + 1 == train.steps)
            self.step_bytes += self.ledger.payload_bytes - sent
            self.telemetry.window.add(stats)
            totals.add(stats)
            if stats.terms:  # a fedavg client that sat the step out has no loss
                recent.append(stats.loss)
            done = step + 1
            self.bar.update(done, stats.loss, stats.terms / max(stats.total_s, 1e-9))
            evaluate_now = train.eval_every and done % train.eval_every == 0
            if evaluate_now or done == train.steps:
                last_eval = self.evaluate()
            if self.checkpoints.due(done) and self.sync.at_boundary(done):
                with self.tracer.span("checkpoint"):
                    self.checkpoints.save(done, self.position)
            maybe_fail("train.step", self.runtime.rank, done)
            if done % train.log_every == 0 or done == train.steps or evaluate_now:
                self._log(done, last_eval if evaluate_now or done == train.steps else None)
        self.bar.close()
        self.checkpoints.close()
        final_loss = sum(recent) / len(recent) if recent else float("nan")
        return self._finish(initial_eval, last_eval, totals, final_loss,
                            time.perf_counter() - start)

    def _train_step(self, step: int):
        """One optimizer step on this rank's share of the global batch."""
        lr = lr_at(step, self.config.train, self.plan.lr)
        set_lr(self.optimizer, lr)
        self.current_lr = lr
        rank = self.topology.dp_rank
        share = self.splitter.shares[rank]
        indices = self.sampler.indices(self.position + self.splitter.offsets()[rank], share)
        size = self.plan.batch.micro_batch
        indices = self.sync.select(step, indices)
        micro = [indices[i:i + size] for i in range(0, len(indices), size)]
        with self.tracer.span("step", step=step + 1):
            # a fedavg client sitting this round out does not step
            stats = self.stepper.run(micro) if micro or not self.sync.local_gradients \
                else StepStats()
        if self.stepper.terms_are_samples:
            self.bar.unit = "samples"
        self.position += self.plan.batch.global_batch
        return stats

    def _run_async(self) -> dict[str, Any]:
        """train.sync=async: parameter servers and workers run their own loop; no
        checkpoints are written."""
        train, b = self.config.train, self.plan.batch
        start = time.perf_counter()
        initial_eval = self.evaluate()
        self.bar.message(self._banner(initial_eval))
        result = self.sync.run(
            optimizer=self.optimizer, steps=train.steps, sampler=self.sampler,
            per_worker=b.global_batch // b.dp, micro_batch=b.micro_batch,
            compute=self.stepper.gradients, lr_at=lambda s: lr_at(s, train, self.plan.lr),
            log=self._log_async, log_every=train.log_every)
        self.position = result["samples"]
        totals = StatsWindow()
        totals.add(StepStats(terms=result["terms"], total_s=result["loop_s"]))
        final_eval = self.evaluate()
        self.bar.close()
        self.checkpoints.close()
        return self._finish(initial_eval, final_eval, totals, result["train_loss"],
                            time.perf_counter() - start)

    def _log_async(self, record: dict[str, Any]) -> None:
        self.bar.update(record["step"], record["loss"], 0.0)
        self.telemetry.writer.write(record)

    def _load(self, indices: list[int]) -> tuple[Any, Any]:
        batch = self.collate_fn([self.dataset[i] for i in indices])
        return split_batch(to_device(batch, self.runtime.device))

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean held-out loss over ``train.eval_samples`` samples, split across dp ranks;
        one all-reduce at the end, so uneven shares never desynchronise ranks."""
        if self.eval_dataset is None:
            return None
        self.model.eval()
        pipelined = self.mp is not None and bool(self.mp.chunks)
        indices = eval_indices(len(self.eval_dataset), self.config.train.eval_samples,
                               self.dp_comm.rank, self.dp_comm.size)
        totals = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        size = self.plan.batch.micro_batch
        for start in range(0, len(indices), size):
            chunk = indices[start:start + size]
            batch = self.collate_fn([self.eval_dataset[i] for i in chunk])
            inputs, targets = split_batch(to_device(batch, self.runtime.device))
            with autocast(self.config.train.precision, self.runtime.device):
                if pipelined:
                    loss_sum, count = pipeline_eval_totals(
                        self.mp, self.loss_fn, inputs, targets, self.config.model.d_model)
                else:
                    loss_sum, count, _ = loss_sum_and_terms(self.loss_fn, self.model(inputs),
                                                            targets)
            totals[0] += loss_sum
            totals[1] += count
        # a pipeline counts each loss on one rank of the last stage: sum over everyone
        (self.world if pipelined else self.dp_comm).all_reduce(totals)
        self.model.train()
        return float(totals[0] / totals[1].clamp(min=1))

    # ----------------------------------------------------------------- outputs
    def _banner(self, initial_eval: float | None) -> str:
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
        if self.mp is None:
            return ""
        lay = self.plan.layout
        mine = (f"rank {self.runtime.rank} (pp {self.mp.pp_comm.rank}, dp "
                f"{self.topology.dp_rank}, tp {self.mp.tp_comm.rank}): {self.mp.describe()}")
        head = (f"\nlayout pp={lay.pp} x dp={lay.dp} x tp={lay.tp}"
                + (f", schedule {self.mp.schedule.name} with {self.mp.schedule.m} "
                   f"micro-batches" if self.mp.schedule else ""))
        return head + "".join(f"\n  {line}" for line in self.world.all_gather_object(mine))

    def _log(self, step: int, eval_loss: float | None) -> None:
        record: dict[str, Any] = {
            "step": step, "lr": self.current_lr, "grad_norm": self.stepper.grad_norm,
            "samples_per_s": self.telemetry.window.steps * self.plan.batch.global_batch
            / max(self.telemetry.window.sum.total_s, 1e-9),
            "samples_seen": self.position, "shares": list(self.splitter.shares),
            "checkpoint_stall_s": self.checkpoints.stall_s}
        if self.stepper.scaler.enabled:
            record |= {"loss_scale": self.stepper.scaler.scale,
                       "skipped_steps": self.stepper.scaler.skipped}
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
        record["memory_mb"] = {k: v / 2**20 for k, v in self._memory().items()}
        record["comm_bytes_per_step"] = ((self.step_bytes - self.logged_bytes)
                                         / max(self.telemetry.window.steps, 1))
        self.logged_bytes = self.step_bytes
        record |= self.sync.metrics()
        record |= getattr(self.dp, "comm_stats", dict)()  # bytes sent, compression ratio
        ranks = self.telemetry.log(record, self.stepper.flops_per_term)
        self.splitter.update([r["samples"] for r in ranks],
                             [r["compute_s"] + r["data_s"] for r in ranks])

    def _finish(self, initial_eval: float | None, final_eval: float | None,
                totals: StatsWindow, final_loss: float, wall_time: float) -> dict[str, Any]:
        summary = {
            "steps": self.config.train.steps, "start_step": self.start_step,
            "world_size": self.runtime.world_size,
            "layout": {"dp": self.plan.layout.dp, "pp": self.plan.layout.pp,
                       "tp": self.plan.layout.tp, "zero": self.plan.layout.zero},
            "global_batch": self.plan.batch.global_batch,
            "final_train_loss": final_loss,
            "initial_eval_loss": initial_eval, "final_eval_loss": final_eval,
            "wall_time_s": wall_time, "train_time_s": totals.sum.total_s,
            "tokens_per_s": totals.terms_per_s(),
            "samples_seen": self.position, "run_dir": str(self.run_dir),
            "parameters": self.total_params,
            "comm_bytes_per_step": self.step_bytes / max(self.config.train.steps
                                                         - self.start_step, 1),
            "collectives": self.ledger.seq,
        }
        if self.stepper.flops_per_term:
            summary["model_flops_per_s"] = (summary["tokens_per_s"]
                                            * self.stepper.flops_per_term)
        summary["memory_bytes"] = self._memory()
        summary |= self.sync.metrics()
        self.dp.finalize()  # the model keeps its full parameters (ZeRO-3 gathers them)
        full = (gather_full_state(self.mp, self.world, self.topology.dp_rank)
                if self.mp is not None else None)
        if self.runtime.is_main:
            rundir.save_weights(full if self.mp is not None else self.model, self.run_dir)
            rundir.write_summary(self.run_dir, summary)
            self.bar.message(_summary_text(summary, self.bar.unit))
        self._write_trace()
        return summary

    def _memory(self) -> dict[str, int]:
        """This rank's model state and the activations of one micro-batch's forward."""
        return {**self.dp.model_state_bytes(self.optimizer),
                "activations": self.stepper.activation_bytes or 0}

    def _write_trace(self) -> None:
        """Each rank writes its spans; rank 0 merges them into ``trace.json``."""
        if self.tracer.enabled:
            self.tracer.write(self.run_dir / f"trace-rank{self.runtime.rank}.json")
        self.world.barrier()
        if self.tracer.enabled and self.runtime.is_main:
            parts = [self.run_dir / f"trace-rank{r}.json"
                     for r in range(self.runtime.world_size)]
            merge_traces(parts, self.run_dir / "trace.json")

    def _close(self) -> None:
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        if hasattr(self, "telemetry"):
            self.telemetry.close()


def _summary_text(s: dict[str, Any], unit: str) -> str:
    ev = ("" if s["final_eval_loss"] is None else
          f"held-out loss {s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}; ")
    return (f"done: {s['steps']} steps in {s['wall_time_s']:.1f}s on {s['world_size']} "
            f"rank(s); train loss {s['final_train_loss']:.4f}; {ev}"
            f"{s['tokens_per_s']:,.0f} {unit}/s; run dir {s['run_dir']}")
