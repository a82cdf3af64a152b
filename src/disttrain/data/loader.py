"""Micro-batches assembled ahead of use, in loader worker processes.

The global sample order decides every micro-batch's indices in advance (a position in
the stream and this rank's share), so the trainer hands :class:`PrefetchingLoader` the
index lists of the current step and a generator of the steps after it; ``workers``
processes (torch's ``DataLoader``) fetch and collate them, ``prefetch`` each ahead,
into pinned host memory when the batches are bound for a GPU. A batch is a pure
function of its indices, so what the workers produce is exactly what loading in the
training process would give; :meth:`PrefetchingLoader.take` checks the indices of
every batch it returns against those asked for, and when they differ (the dynamic
balancer moved the shares, a sync mode selected other samples) it answers None, the
caller loads that micro-batch itself, and the stream restarts from the next one. The
position a checkpoint records is the trainer's, of the batches consumed, never of
those prefetched, so resuming is exact with any number of workers.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler

from .samples import fetch_samples

FuturePlan = Callable[[], Iterator[list[int]]]
# fork: the workers inherit the dataset and the collate function (a lambda, a memory
# map) instead of receiving them pickled; newer Pythons default to forkserver
_START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else None


class _IndexListDataset(Dataset):
    """Key: a tuple of dataset indices -> (the key, its collated samples); runs in the
    workers."""

    def __init__(self, dataset: Any, collate: Callable[[list], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __getitem__(self, key: tuple[int, ...]) -> tuple[tuple[int, ...], Any]:
        return key, self.collate(fetch_samples(self.dataset, list(key)))

    def __len__(self) -> int:
        return len(self.dataset)


class _Plan(Sampler):
    """The keys to load next; replaced before each restart of the stream."""

    def __init__(self) -> None:
        self.keys: Iterator[tuple[int, ...]] = iter(())

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return self.keys


def _as_is(item: Any) -> Any:
    return item


class _WorkerStart:
    """DataLoader's ``worker_init_fn``: the caller's ``in_worker``, if any."""

    def __init__(self, in_worker: Callable[[], None] | None) -> None:
        self.in_worker = in_worker

    def __call__(self, worker_id: int) -> None:
        if self.in_worker is not None:
            self.in_worker()


class PrefetchingLoader:
    """Loads the micro-batches a plan names, ``workers`` processes ahead of use."""

    def __init__(self, dataset: Any, collate: Callable[[list], Any], workers: int, *,
                 pin_memory: bool = False, prefetch: int = 2,
                 in_worker: Callable[[], None] | None = None) -> None:
        """``in_worker``: run first in each worker process (to let go of what it
        inherited from the trainer and must not hold, such as a lock)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._plan = _Plan()
        self._data: DataLoader | None = DataLoader(
            _IndexListDataset(dataset, collate), batch_size=None, sampler=self._plan,
            num_workers=workers, collate_fn=_as_is, pin_memory=pin_memory,
            prefetch_factor=prefetch, persistent_workers=True,
            multiprocessing_context=_START_METHOD, worker_init_fn=_WorkerStart(in_worker))
        self._stream: Iterator[tuple[tuple[int, ...], Any]] | None = None
        self._following = False  # no plan yet: everything loads in the caller
        self._step: Sequence[list[int]] = ()
        self._future: FuturePlan = lambda: iter(())
        self._taken = 0
        self.restarts = 0  # streams started again after a batch differed from the plan

    def follow(self, step_lists: Sequence[list[int]], future: FuturePlan) -> None:
        """The micro-batches of the step about to run, in order, and the lists of the
        steps after it as the trainer expects them now."""
        self._step, self._future, self._taken = step_lists, future, 0
        self._following = True
        if self._stream is None:
            self._restart(0)

    def take(self, indices: list[int]) -> Any | None:
        """The collated batch of ``indices`` if it is the next one the workers made,
        else None (load it in this process; the stream restarts after it). Before
        any :meth:`follow`, always None."""
        if not self._following:
            return None
        at = self._taken
        self._taken += 1
        if self._stream is not None:
            key, batch = next(self._stream)
            if key == tuple(indices):
                return batch
        self.restarts += 1
        self._restart(at + 1)
        return None

    def _restart(self, start: int) -> None:
        lists = [tuple(x) for x in self._step[start:]]
        self._plan.keys = itertools.chain(lists, (tuple(x) for x in self._future()))
        if self._data is None:
            raise RuntimeError("the loader is closed: no batch can be loaded after close()")
        self._stream = iter(self._data)

    def close(self) -> None:
        """Stop the worker processes."""
        self._stream = None
        self._data = None
