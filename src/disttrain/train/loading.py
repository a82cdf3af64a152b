"""The training steps' micro-batches: loaded in this process, or by loader workers
ahead of use (``data.workers``, :class:`~disttrain.data.loader.PrefetchingLoader`),
then split into what the model and the loss take and moved to the device."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..data.loader import FuturePlan, PrefetchingLoader
from ..data.sampler import GlobalOrderSampler
from ..data.samples import fetch_samples
from .batch import Batch, split_batch, to_device


class StepLoader:
    """``load(indices)``: a step's micro-batch as a :class:`~.batch.Batch` on
    ``device``; with ``workers`` > 0 taken from the workers when they made it, else
    (and for anything off the plan) loaded here."""

    def __init__(self, dataset: Any, collate: Callable[[list], Any], device: torch.device,
                 call_kwargs: Mapping[str, Any] | None, workers: int,
                 in_worker: Callable[[], None] | None = None) -> None:
        self.dataset, self.collate, self.device = dataset, collate, device
        self.call_kwargs = call_kwargs
        self.workers = None if workers == 0 else PrefetchingLoader(
            dataset, collate, workers, pin_memory=device.type == "cuda",
            in_worker=in_worker)

    def follow(self, step_lists: list[list[int]], future: FuturePlan) -> None:
        """The step about to run and the ones expected after it (see
        :meth:`PrefetchingLoader.follow`)."""
        if self.workers is not None:
            self.workers.follow(step_lists, future)

    def load(self, indices: list[int]) -> Batch:
        batch = None if self.workers is None else self.workers.take(indices)
        if batch is None:
            batch = self.collate(fetch_samples(self.dataset, indices))
        return split_batch(to_device(batch, self.device), self.call_kwargs)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


def planned_lists(sampler: GlobalOrderSampler, position: int, offset: int, share: int,
                  global_batch: int, split: Callable[[list[int]], list[list[int]]]
                  ) -> FuturePlan:
    """The micro-batch index lists of the steps after the one at ``position``, as this
    rank (its ``offset`` in the global batch and its ``share``) would take them if
    nothing changes; ``sampler``: one of its own (its epoch cache is not the
    trainer's)."""
    def lists() -> Iterator[list[int]]:
        for step in itertools.count(1):
            start = position + step * global_batch + offset
            yield from split(sampler.indices(start, share))
    return lists
