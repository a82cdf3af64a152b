"""Metric records from every rank, aggregated at each logged step.

At a logged step every rank contributes its per-step averages (timings, memory,
samples) through one all-gather; rank 0 writes the record: the global figures, MFU, the
per-rank list, and the stragglers. The gathered figures are returned on every rank, so
the dynamic batch splitter sees the same numbers everywhere.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Communicator
from .metrics import MetricsWriter
from .stats import STAT_FIELDS, StatsWindow, StragglerDetector, lower_median, memory_mb

_GATHERED = (*STAT_FIELDS, "samples", "mem_mb", "mem_peak_mb")


class TensorBoardWriter:
    """Scalars to ``run_dir/tensorboard`` when the tensorboard package is installed."""

    def __init__(self, directory: str | None) -> None:
        self.writer = None
        if directory is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional extra: pip install 'disttrain[tensorboard]'
            return
        self.writer = SummaryWriter(directory)

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Telemetry:
    def __init__(self, comm: Communicator, device: torch.device, writer: MetricsWriter,
                 tensorboard: TensorBoardWriter, stragglers: StragglerDetector,
                 peak_flops: float, say: Any) -> None:
        self.comm, self.device = comm, device
        self.writer, self.tensorboard = writer, tensorboard
        self.detector, self.peak_flops, self.say = stragglers, peak_flops, say
        self.window = StatsWindow()
        self.flagged: set[int] = set()

    def gather(self) -> list[dict[str, float]]:
        """Every rank's per-step averages over the current window (a collective)."""
        w = self.window
        current, peak = memory_mb(self.device)
        mine = [w.per_step(f) for f in STAT_FIELDS] + [w.per_step("samples"), current, peak]
        rows = self.comm.all_gather(torch.tensor(mine, dtype=torch.float64,
                                                 device=self.device))
        return [dict(zip(_GATHERED, row.tolist())) | {"rank": r} for r, row in
                enumerate(rows)]

    def log(self, record: dict[str, Any], flops_per_term: float | None
            ) -> list[dict[str, float]]:
        """Complete ``record`` (step, lr, ... from the trainer) and write it on rank 0."""
        ranks = self.gather()
        w = self.window
        busy = [r["compute_s"] + r["data_s"] for r in ranks]
        stragglers = self.detector.update(busy)
        record.update({
            "loss": w.loss(), "tokens_per_s": w.terms_per_s(),
            "step_time_s": w.per_step("total_s"),
            **{f"time_{k.removesuffix('_s')}_s": sum(r[k] for r in ranks) / len(ranks)
               for k in ("compute_s", "comm_s", "data_s", "optim_s")},
            "mem_peak_mb": max(r["mem_peak_mb"] for r in ranks),
            "ranks": [{k: r[k] for k in ("rank", "total_s", "compute_s", "comm_s",
                                         "data_s", "samples", "mem_peak_mb")}
                      for r in ranks],
            "stragglers": stragglers,
        })
        if flops_per_term and self.peak_flops > 0:
            record["mfu"] = (w.terms_per_s() * flops_per_term
                             / (self.peak_flops * len(ranks)))
        self._announce(stragglers, busy)
        self.writer.write(record)
        self.tensorboard.write(record)
        w.reset()
        return ranks

    def _announce(self, stragglers: list[int], busy: list[float]) -> None:
        median = lower_median(busy)
        for rank in sorted(set(stragglers) - self.flagged):
            self.say(f"straggler: rank {rank} is {busy[rank] / max(median, 1e-9):.1f}x "
                     f"slower than the median rank ({busy[rank]:.3f}s vs {median:.3f}s "
                     "of compute + data wait per step)")
        self.flagged = set(stragglers)

    def close(self) -> None:
        self.writer.close()
        self.tensorboard.close()
