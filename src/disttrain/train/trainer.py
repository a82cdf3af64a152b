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

import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, default_collate

from ..comm import CollectiveLedger, Communicator
from ..config import Config, RunPlan, load_config, resolve
from ..config.dump import config_to_toml
from ..data.sampler import GlobalOrderSampler, eval_indices
from ..faults import maybe_fail
from ..monitor import MetricsWriter, ProgressBar
from ..monitor.metrics import truncate_metrics
from ..parallel.data import DataParallel, apply_data_parallel
from ..topology import Topology, build_topology
from . import rundir
from .checkpointing import RunCheckpoints
from .optim import build_optimizer, lr_at, set_lr
from .runtime import Runtime, init_runtime, shutdown, world_size_from_env

LossFn = Callable[[Any, Any], "torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]"]


def _as_config(config: Config | Mapping | None) -> Config:
    if config is None:
        return load_config()
    if isinstance(config, Config):
        return config
    return load_config(values=dict(config))


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) from a collated batch: a pair, or a mapping with
    ``input_ids`` and ``targets``."""
    if isinstance(batch, Mapping):
        return batch["input_ids"], batch["targets"]
    inputs, targets = batch
    return inputs, targets


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


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
            self.metrics.close() if hasattr(self, "metrics") else None
            shutdown(runtime)

    def _build(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.topology: Topology = build_topology(self.plan.layout, runtime.device.type)
        self.ledger = CollectiveLedger()
        self.world = Communicator(None, self.ledger, "world")
        self.dp_comm = Communicator(self.topology.group("dp"), self.ledger, "dp")
        self._build_model()
        self._build_data()
        self._build_outputs()
        self._build_checkpoints()

    def _build_model(self) -> None:
        self.model.to(self.runtime.device)
        self.dp: DataParallel = apply_data_parallel(
            self.model, self.dp_comm, bucket_mb=self.config.parallel.bucket_mb)
        self.optimizer = build_optimizer(self.model, self.config.train, self.plan.lr)

    def _build_data(self) -> None:
        self.sampler = GlobalOrderSampler(len(self.dataset), self.config.train.seed)
        self.position = 0  # global sample index of the next global batch

    def _build_outputs(self) -> None:
        main = self.runtime.is_main
        chosen = self.run_dir or (rundir.new_run_dir_name() if main else None)
        self.run_dir = Path(self.world.broadcast_object(str(chosen) if chosen else None))
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            rundir.write_text_atomic(self.run_dir / rundir.CONFIG_FILE,
                                     config_to_toml(self.config, self.plan))
        self.metrics = MetricsWriter(self.run_dir / rundir.METRICS_FILE if main else None)
        self.bar = ProgressBar(self.config.train.steps, enabled=main, show_bar=self.progress,
                               every=self.config.train.log_every)

    def _build_checkpoints(self) -> None:
        self.checkpoints = RunCheckpoints(self.run_dir, self.config, self.plan, self.world,
                                          self.model, self.optimizer)
        self.start_step = 0
        resumed = self.checkpoints.resume(say=self.bar.message)
        if resumed is not None:
            self.start_step, self.position = resumed
            if self.runtime.is_main:  # records past the checkpoint are redone
                truncate_metrics(self.run_dir / rundir.METRICS_FILE, self.start_step)

    # ----------------------------------------------------------------- the loop
    def _run(self) -> dict[str, Any]:
        train = self.config.train
        start = time.perf_counter()
        initial_eval = self.evaluate()
        self.bar.message(self._banner(initial_eval))
        window, totals = _Window(), _Window()
        recent: deque[float] = deque(maxlen=10)
        last_eval = initial_eval
        for step in range(self.start_step, train.steps):
            loss, count, seconds, data_s = self._train_step(step)
            window.add(loss, count, seconds, data_s)
            totals.add(loss, count, seconds, data_s)
            recent.append(loss)
            done = step + 1
            self.bar.update(done, loss, count / max(seconds, 1e-9))
            evaluate_now = train.eval_every and done % train.eval_every == 0
            if evaluate_now or done == train.steps:
                last_eval = self.evaluate()
            if self.checkpoints.due(done):
                self.checkpoints.save(done, self.position)
            maybe_fail("train.step", self.runtime.rank, done)
            if done % train.log_every == 0 or done == train.steps or evaluate_now:
                self._log(done, window, last_eval if evaluate_now or done == train.steps
                          else None)
        self.bar.close()
        self.checkpoints.close()
        final_loss = sum(recent) / len(recent) if recent else float("nan")
        return self._finish(initial_eval, last_eval, totals, final_loss,
                            time.perf_counter() - start)

    def _train_step(self, step: int) -> tuple[float, int, float, float]:
        """One optimizer step over this rank's micro-batches of the global batch.
        Returns (global mean loss, global loss terms, seconds, seconds loading data)."""
        t0 = time.perf_counter()
        b = self.plan.batch
        lr = lr_at(step, self.config.train, self.plan.lr)
        set_lr(self.optimizer, lr)
        self.current_lr = lr
        micro = self.sampler.micro_batches(self.position, b.global_batch,
                                           self.topology.dp_rank, b.dp, b.grad_accum)
        self.dp.zero_grad()
        totals = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        data_s, handle = 0.0, None
        for i, indices in enumerate(micro):
            last = i == len(micro) - 1
            td = time.perf_counter()
            inputs, targets = self._load(indices)
            data_s += time.perf_counter() - td
            with contextlib.nullcontext() if last else self.dp.no_sync():
                loss_sum, count = self._loss_sum(self.model(inputs), targets)
                totals[0] += loss_sum.detach().double()
                totals[1] += count
                if last:  # overlaps the last backward
                    handle = self.dp_comm.all_reduce(totals, async_op=True)
                loss_sum.backward()
        handle.wait()
        global_loss, global_count = totals.tolist()
        self.dp.finish_gradient_sync(1.0 / max(global_count, 1.0))
        self.grad_norm = self._clip()
        self.optimizer.step()
        self.position += b.global_batch
        seconds = time.perf_counter() - t0
        return global_loss / max(global_count, 1.0), int(global_count), seconds, data_s

    def _load(self, indices: list[int]) -> tuple[Any, Any]:
        batch = self.collate_fn([self.dataset[i] for i in indices])
        return split_batch(_to(batch, self.runtime.device))

    def _loss_sum(self, outputs: Any, targets: Any) -> tuple[torch.Tensor, int]:
        result = self.loss_fn(outputs, targets)
        if isinstance(result, tuple):
            loss_sum, count = result
            return loss_sum, int(count)
        self.bar.unit = "samples"  # a mean loss: one term per sample
        n = len(targets)
        return result * n, n

    def _clip(self) -> float:
        clip = self.config.train.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        return float(norm)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean held-out loss over ``train.eval_samples`` samples, split across dp ranks;
        one all-reduce at the end, so uneven shares never desynchronise ranks."""
        if self.eval_dataset is None:
            return None
        self.model.eval()
        indices = eval_indices(len(self.eval_dataset), self.config.train.eval_samples,
                               self.topology.dp_rank, self.plan.batch.dp)
        totals = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        size = self.plan.batch.micro_batch
        for start in range(0, len(indices), size):
            chunk = indices[start:start + size]
            batch = self.collate_fn([self.eval_dataset[i] for i in chunk])
            inputs, targets = split_batch(_to(batch, self.runtime.device))
            loss_sum, count = self._loss_sum(self.model(inputs), targets)
            totals[0] += loss_sum.double()
            totals[1] += count
        self.dp_comm.all_reduce(totals)
        self.model.train()
        return float(totals[0] / totals[1].clamp(min=1))

    # ----------------------------------------------------------------- outputs
    def _banner(self, initial_eval: float | None) -> str:
        lay, b = self.plan.layout, self.plan.batch
        text = (f"disttrain: {self.runtime.world_size} rank(s) on "
                f"{self.runtime.device.type}/{self.runtime.backend}, dp={lay.dp}; "
                f"global batch {b.global_batch} = {b.micro_batch} x {b.grad_accum} x "
                f"{b.dp}; {sum(p.numel() for p in self.model.parameters()):,} parameters; "
                f"run dir {self.run_dir}")
        if initial_eval is not None:
            text += f"\ninitial held-out loss {initial_eval:.4f}"
        return text

    def _log(self, step: int, window: _Window, eval_loss: float | None) -> None:
        record = {"step": step, "loss": window.loss(), "lr": self.current_lr,
                  "grad_norm": self.grad_norm, "tokens_per_s": window.rate(),
                  "samples_per_s": window.steps * self.plan.batch.global_batch
                  / max(window.seconds, 1e-9),
                  "step_time_s": window.seconds / max(window.steps, 1),
                  "data_time_s": window.data_seconds / max(window.steps, 1),
                  "samples_seen": self.position,
                  "checkpoint_stall_s": self.checkpoints.stall_s}
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
        self.metrics.write(record)
        window.reset()

    def _finish(self, initial_eval: float | None, final_eval: float | None,
                totals: _Window, final_loss: float, wall_time: float) -> dict[str, Any]:
        steps = self.config.train.steps
        summary = {
            "steps": steps, "start_step": self.start_step,
            "world_size": self.runtime.world_size,
            "layout": {"dp": self.plan.layout.dp, "pp": self.plan.layout.pp,
                       "tp": self.plan.layout.tp, "zero": self.plan.layout.zero},
            "global_batch": self.plan.batch.global_batch,
            "final_train_loss": final_loss,
            "initial_eval_loss": initial_eval, "final_eval_loss": final_eval,
            "wall_time_s": wall_time, "train_time_s": totals.seconds,
            "tokens_per_s": totals.rate(),
            "samples_seen": self.position, "run_dir": str(self.run_dir),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }
        if self.flops_per_token:
            summary["model_flops_per_s"] = summary["tokens_per_s"] * self.flops_per_token
        if self.runtime.is_main:
            rundir.save_weights(self.model, self.run_dir)
            rundir.write_summary(self.run_dir, summary)
            self.bar.message(_summary_text(summary, self.bar.unit))
        dist.barrier()
        return summary


def _summary_text(s: dict[str, Any], unit: str) -> str:
    ev = ("" if s["final_eval_loss"] is None else
          f"held-out loss {s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}; ")
    return (f"done: {s['steps']} steps in {s['wall_time_s']:.1f}s on {s['world_size']} "
            f"rank(s); train loss {s['final_train_loss']:.4f}; {ev}"
            f"{s['tokens_per_s']:,.0f} {unit}/s; run dir {s['run_dir']}")


class _Window:
    """Accumulates steps between two metric records."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps, self.seconds, self.data_seconds = 0, 0.0, 0.0
        self.loss_terms, self.loss_total = 0, 0.0

    def add(self, loss: float, count: int, seconds: float, data_seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.data_seconds += data_seconds
        self.loss_total += loss * count
        self.loss_terms += count

    def loss(self) -> float:
        return self.loss_total / max(self.loss_terms, 1)

    def rate(self) -> float:
        return self.loss_terms / max(self.seconds, 1e-9)
