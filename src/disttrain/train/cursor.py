"""Where a run is in the global sample order, and this rank's share of each step.

The order is one permutation of the training set per epoch (train.seed), the same on
every rank; each step takes the next ``global_batch`` samples of it, split over the
ranks that share it (the data-parallel ranks) by the splitter (equal shares, or
rebalanced by measured speed), then cut into micro-batches. The loader is told the
coming steps' lists, so its workers read ahead.
"""

from __future__ import annotations

from ..config import BatchPlan
from ..data.sampler import GlobalOrderSampler
from ..parallel.balance import BatchSplitter, micro_batch_sizes
from .loading import StepLoader, planned_lists


class DataCursor:
    """The sample order from ``position`` (global index of the next global batch) for
    the rank that takes share ``index`` of each batch; ``dynamic``: shares follow each
    rank's measured speed."""

    def __init__(self, num_samples: int, seed: int, batch: BatchPlan, index: int,
                 dynamic: bool, loader: StepLoader) -> None:
        self.sampler = GlobalOrderSampler(num_samples, seed)
        self._ahead = GlobalOrderSampler(num_samples, seed)  # the loader's read-ahead
        self.splitter = BatchSplitter(batch.global_batch, batch.shares, dynamic)
        self.batch, self.index, self.loader = batch, index, loader
        self.position = 0
        # fault tolerance: this replica group's (offset, size) of the global batch
        # under the step's quorum, in place of the splitter's share
        self.window: tuple[int, int] | None = None

    def _slice(self) -> tuple[int, int]:
        if self.window is not None:
            return self.window
        return self.splitter.offsets()[self.index], self.splitter.shares[self.index]

    def share(self) -> list[int]:
        """This rank's dataset indices of the step at :attr:`position`."""
        offset, share = self._slice()
        return self.sampler.indices(self.position + offset, share)

    def micro_batches(self, indices: list[int]) -> list[list[int]]:
        """``indices`` as the step's micro-batches: the same count on every rank (enough
        for the largest share), each at most ``micro_batch`` samples."""
        size = self.batch.micro_batch
        count = (self.splitter.micro_batches(size) if self.window is None
                 else max(1, -(-len(indices) // size)))
        sizes = micro_batch_sizes(len(indices), size, count)
        out, start = [], 0
        for n in sizes:
            out.append(indices[start:start + n])
            start += n
        return out

    def follow(self, lists: list[list[int]]) -> None:
        """Hand the loader this step's lists and the coming steps' plan."""
        offset, share = self._slice()
        self.loader.follow(lists, planned_lists(
            self._ahead, self.position, offset, share,
            self.batch.global_batch, self.micro_batches))

    def advance(self) -> None:
        """Past the step just taken."""
        self.position += self.batch.global_batch

    def first_micro_batch(self) -> list[int]:
        """The indices of the sample order's first micro-batch."""
        return self.sampler.indices(0, self.batch.micro_batch)
