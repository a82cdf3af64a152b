"""Metric records from every rank, aggregated at each logged step.

At a logged step every rank contributes its per-step averages (timings, memory,
samples) through one all-gather; rank 0 writes the record: the global figures, MFU, the
per-rank list, and the stragglers. The gathered figures are returned on every rank, so
the dynamic batch splitter sees the same numbers everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ..comm import Communicator
from .metrics import MetricsWriter
from .peaks import Peak, model_flops_utilisation
from .record import (
    MEM_PEAK_MB,
    RANK,
    RANK_COMM_S,
    RANK_COMPUTE_S,
    RANK_DATA_S,
    RANK_FIELDS,
    RANK_OPTIM_S,
    RANK_SAMPLES,
    MetricsRecord,
    as_record,
)
from .stats import STAT_FIELDS, StatsWindow, StragglerDetector, lower_median, memory_mb

_GATHERED = (*STAT_FIELDS, RANK_SAMPLES, "mem_mb", MEM_PEAK_MB)


class Telemetry:
    def __init__(self, comm: Communicator, device: torch.device, writer: MetricsWriter,
                 stragglers: StragglerDetector, peak: Peak, say: Any) -> None:
        self.comm, self.device = comm, device
        self.writer = writer
        self.detector, self.peak, self.say = stragglers, peak, say
        self.window = StatsWindow()
        self.flagged: set[int] = set()

    def gather(self) -> list[dict[str, float]]:
        """Every rank's per-step averages over the current window (a collective)."""
        w = self.window
        current, peak = memory_mb(self.device)
        mine = [w.per_step(f) for f in STAT_FIELDS] + [w.per_step(RANK_SAMPLES), current, peak]
        rows = self.comm.all_gather(torch.tensor(mine, dtype=torch.float64,
                                                 device=self.device))
        return [dict(zip(_GATHERED, row.tolist(), strict=True)) | {RANK: r} for r, row in
                enumerate(rows)]

    def log(self, record: MetricsRecord | Mapping[str, Any], flops_per_token: float | None
            ) -> tuple[MetricsRecord, list[dict[str, float]]]:
        """Complete ``record`` (step, lr, ... from the trainer) with the figures of
        every rank and write it on rank 0; return it and those figures (on every
        rank)."""
        ranks = self.gather()
        busy = [r[RANK_COMPUTE_S] + r[RANK_DATA_S] for r in ranks]
        stragglers = self.detector.update(busy)
        mfu = model_flops_utilisation(self.window.positions_per_s(), flops_per_token,
                                      self.peak.flops, len(ranks))
        record = replace(as_record(record), **self._window_fields(ranks),
                         stragglers=stragglers, mfu=mfu,
                         peak_source=None if mfu is None else self.peak.source)
        self._announce(stragglers, busy)
        self.writer.write(record)
        self.window.reset()
        return record, ranks

    def _window_fields(self, ranks: list[dict[str, float]]) -> dict[str, Any]:
        """The record's loss, throughput and time split over the window: per step,
        averaged over ``ranks`` where each rank measured its own."""
        w = self.window

        def mean(key: str) -> float:
            return sum(r[key] for r in ranks) / len(ranks)
        return dict(loss=w.loss(), tokens_per_s=w.positions_per_s(),
                    trained_tokens_per_s=w.terms_per_s(),
                    step_time_s=w.wall_per_step(),
                    time_compute_s=mean(RANK_COMPUTE_S), time_comm_s=mean(RANK_COMM_S),
                    time_data_s=mean(RANK_DATA_S), time_optim_s=mean(RANK_OPTIM_S),
                    mem_peak_mb=max(r[MEM_PEAK_MB] for r in ranks),
                    ranks=[{k: r[k] for k in RANK_FIELDS} for r in ranks])

    def _announce(self, stragglers: list[int], busy: list[float]) -> None:
        median = lower_median(busy)
        for rank in sorted(set(stragglers) - self.flagged):
            self.say(f"straggler: rank {rank} is {busy[rank] / max(median, 1e-9):.1f}x "
                     f"slower than the median rank ({busy[rank]:.3f}s vs {median:.3f}s "
                     "of compute + data wait per step)")
        self.flagged = set(stragglers)

    def close(self) -> None:
        self.writer.close()
