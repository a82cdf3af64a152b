"""What a run tells its user: the progress line, metrics records, callbacks and loggers,
the start-up banner and the closing summary line.

:class:`RunReporter` holds the progress bar, the telemetry (metrics records gathered
from every rank, stragglers) and the callbacks, and hands each callback the Trainer as
its subject; the text of the banner and the summary is built by the functions below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config.layout import Layout
from ..dimensions import Role, mesh_order, with_role
from ..monitor import MetricsRecord, ProgressBar
from ..monitor.callbacks import Callbacks
from ..monitor.callbacks import Trainer as CallbackSubject
from ..monitor.telemetry import Telemetry
from ..parallel.compose import Parallelized


class RunReporter:
    """The bar (rank 0's progress line), ``telemetry`` and ``callbacks``, called with
    ``subject`` (the Trainer)."""

    def __init__(self, subject: CallbackSubject, bar: ProgressBar, telemetry: Telemetry,
                 callbacks: Callbacks) -> None:
        self.subject, self.bar = subject, bar
        self.telemetry, self.callbacks = telemetry, callbacks

    def say(self, text: str) -> None:
        self.bar.message(text)

    def train_start(self) -> None:
        self.callbacks.train_start(self.subject)

    def evaluated(self, step: int, value: float | None) -> None:
        self.callbacks.eval(self.subject, step, value)

    def step_end(self, record: MetricsRecord) -> None:
        self.callbacks.step_end(self.subject, record)

    def checkpoint(self, step: int, path: Path) -> None:
        self.callbacks.checkpoint(self.subject, step, path)

    def log(self, record: MetricsRecord, flops_per_token: float | None
            ) -> list[dict[str, Any]]:
        """Gather ``record`` over the ranks (a collective), write it, and hand rank 0's
        full record to the callbacks; returns every rank's figures."""
        record, ranks = self.telemetry.log(record, flops_per_token)
        self.callbacks.log(self.subject, record)
        return ranks

    def write(self, record: MetricsRecord) -> None:
        """A record already gathered (a loop of its own): written and handed on."""
        self.telemetry.writer.write(record)
        self.callbacks.step_end(self.subject, record)
        self.callbacks.log(self.subject, record)

    def train_end(self, summary: dict[str, Any] | None) -> None:
        """Once (later calls do nothing): the summary, or None when the run stopped
        early."""
        self.callbacks.train_end(self.subject, summary)

    def close(self) -> None:
        """The writers closed; callbacks told of an early end if not told of one."""
        self.bar.close()
        self.telemetry.close()
        self.train_end(None)


def banner_text(world_size: int, device: torch.device, backend: str, plan: Any,
                parameters: int, run_dir: Path, layout_lines: str,
                initial_eval: float | None) -> str:
    """The start-up banner: the world, the batch triple, the model's size, where it
    writes, who holds what (where a dimension changed the model), the first held-out
    loss."""
    planned, b = plan.layout, plan.batch
    split = ", ".join(f"{d.key}={planned.degree(d.key)}" for d in with_role(Role.SAMPLES))
    text = (f"disttrain: {world_size} rank(s) on {device.type}/{backend}, {split}; "
            f"global batch {b.global_batch} = {b.micro_batch} x {b.grad_accum} x "
            f"{b.shares}; {parameters:,} parameters; run dir {run_dir}")
    text += layout_lines
    if initial_eval is not None:
        text += f"\ninitial held-out loss {initial_eval:.4f}"
    return text


def layout_lines(parallel: Parallelized, layout: Layout, micro_batches: int) -> str:
    """For the start-up banner: where a dimension changed the model, the layout in rank
    order with what the cut adds (a pipeline's schedule) and which ranks hold which
    layers and shards (a collective over the world); then how the loss is computed."""
    loss = f"\n{parallel.loss_line}" if parallel.loss_line else ""
    if not parallel.model_parallel.applied:
        return loss
    degrees = " x ".join(f"{d.key}={layout.degree(d.key)}" for d in mesh_order())
    head = f"\nlayout {degrees}" + parallel.model_parallel.cut.headline(micro_batches)
    g = parallel.groups
    where = ", ".join(f"{d.key} {g.axis(d.axis).rank}" for d in mesh_order())
    mine = f"rank {g.world.rank} ({where}): {_part(parallel)}"
    return head + "".join(f"\n  {line}" for line in g.world.all_gather_object(mine)) + loss


def _part(parallel: Parallelized) -> str:
    """This rank's part, in one line: its data-parallel strategy and what each
    dimension gave it."""
    stage = f" (ZeRO-{parallel.zero_stage})" if parallel.zero_stage else ""
    layout = parallel.model_parallel.describe()
    return f"{parallel.strategy}{stage}" + (f"; {layout}" if layout else "")


def device_name(device: torch.device) -> str:
    """``cpu``, or the GPU's name as torch gives it (``NVIDIA H100 80GB HBM3``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def summary_text(s: dict[str, Any], unit: str) -> str:
    """The closing line: the steps run, the time, the losses, the throughput."""
    ev = ("" if s["final_eval_loss"] is None else
          f"held-out loss {s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}; ")
    ran = s["steps"] - s["start_step"]
    which = (f"steps {s['start_step'] + 1}-{s['steps']} of {s['steps']}" if s["start_step"]
             else f"{ran} steps")
    return (f"done: {which} in {s['wall_time_s']:.1f}s on {s['world_size']} "
            f"rank(s); train loss {s['final_train_loss']:.4f}; {ev}"
            f"{s['tokens_per_s']:,.0f} {unit}/s; run dir {s['run_dir']}")
