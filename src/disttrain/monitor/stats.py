"""Per-step timings, memory, and the straggler rule (the peak FLOP/s is in :mod:`.peaks`)."""

from __future__ import annotations

import resource
from dataclasses import dataclass, fields

import torch

from .record import RANK_COMM_S, RANK_COMPUTE_S, RANK_DATA_S, RANK_OPTIM_S, RANK_TOTAL_S

# the timings telemetry gathers from every rank, by StepStats field name
STAT_FIELDS = (RANK_TOTAL_S, RANK_COMPUTE_S, RANK_COMM_S, RANK_DATA_S, RANK_OPTIM_S)


@dataclass
class StepStats:
    """One optimizer step on one rank. ``comm_s`` is exposed communication only (time
    blocked waiting for collectives); ``compute_s`` is forward + backward."""

    loss: float = 0.0
    terms: int = 0        # global loss terms (trained tokens) in the step
    positions: int = 0    # global positions the loss ran over (tokens, trained or not)
    samples: int = 0      # samples this rank processed
    total_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    data_s: float = 0.0
    optim_s: float = 0.0


class StatsWindow:
    """Sums StepStats between two logged steps, and the wall time those steps took.

    ``wall_s`` is what throughput divides by: the wall-clock time of the steps, all of
    it (waiting for other ranks, the work between steps) but held-out evaluation; a
    rank's own ``total_s`` leaves out the time it waits outside its step (e.g. for a
    slow rank at the step boundary), so a rate over it overstates the real one."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.sum = StepStats()
        self.loss_weighted = 0.0
        self.wall_s = 0.0

    def add_wall(self, seconds: float) -> None:
        """Wall-clock seconds the window's steps took (the loop measures them)."""
        self.wall_s += seconds

    def add(self, s: StepStats) -> None:
        self.steps += 1
        for f in fields(StepStats):
            setattr(self.sum, f.name, getattr(self.sum, f.name) + getattr(s, f.name))
        self.loss_weighted += s.loss * s.terms

    def loss(self) -> float:
        return self.loss_weighted / max(self.sum.terms, 1)

    def per_step(self, name: str) -> float:
        return getattr(self.sum, name) / max(self.steps, 1)

    def terms_per_s(self) -> float:
        """Loss terms (trained tokens) per second of wall time."""
        return self.sum.terms / max(self.wall_s, 1e-9)

    def positions_per_s(self) -> float:
        """Positions (tokens processed, trained or not: padding and masked prompts
        included, which the model computes all the same) per second of wall time."""
        return self.sum.positions / max(self.wall_s, 1e-9)

    def samples_per_s(self, global_batch: int) -> float:
        """Global samples per second of wall time."""
        return self.steps * global_batch / max(self.wall_s, 1e-9)

    def wall_per_step(self) -> float:
        return self.wall_s / max(self.steps, 1)

    def busy_s(self) -> float:
        """This rank's time inside its steps, less the time blocked in collectives."""
        return self.sum.total_s - self.sum.comm_s


def memory_mb(device: torch.device) -> tuple[float, float]:
    """(current, peak) memory of this rank in MiB: the GPU allocator's on CUDA, the
    process's resident set on CPU."""
    if device.type == "cuda":
        return (torch.cuda.memory_allocated(device) / 2**20,
                torch.cuda.max_memory_allocated(device) / 2**20)
    with open("/proc/self/statm") as fh:
        rss_pages = int(fh.read().split()[1])
    import os
    current = rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return current, peak


def lower_median(values: list[float]) -> float:
    """The lower middle value: with two ranks, the faster one's time."""
    return sorted(values)[(len(values) - 1) // 2] if values else 0.0


class StragglerDetector:
    """A rank is a straggler once its busy time (compute + data) exceeds the median by
    more than ``threshold`` in ``window`` consecutive logged intervals."""

    def __init__(self, threshold: float, window: int) -> None:
        self.threshold, self.window = threshold, window
        self.streak: dict[int, int] = {}

    def update(self, busy_s: list[float]) -> list[int]:
        median = lower_median(busy_s)
        flagged = []
        for rank, t in enumerate(busy_s):
            slow = median > 0 and t > median * (1 + self.threshold)
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            if self.streak[rank] >= self.window:
                flagged.append(rank)
        return flagged
