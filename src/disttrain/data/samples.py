"""Reading a micro-batch's samples out of any map-style dataset.

A dataset that implements torch's batched-fetch protocol (``__getitems__``, the method
``DataLoader`` calls when it exists: a Hugging Face ``datasets.Dataset``, a torch
``Subset``) gives all of a micro-batch's rows in one call; any other map-style dataset
is indexed one sample at a time.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class BatchFetchDataset(Protocol):
    """torch's optional batched fetch: the samples at ``indices``, in that order."""

    def __getitems__(self, indices: list[int]) -> list[Any]: ...


def fetch_samples(dataset: Any, indices: list[int]) -> list[Any]:
    """The samples of ``dataset`` at ``indices``, in order: one ``__getitems__`` call
    where the dataset has one, else ``dataset[i]`` for each index."""
    if isinstance(dataset, BatchFetchDataset):
        return list(dataset.__getitems__(list(indices)))
    return [dataset[i] for i in indices]


def tensor_rows(dataset: Any) -> Any:
    """``dataset`` itself, except a Hugging Face ``datasets.Dataset`` left in its
    default (Python) format: that is viewed in torch format, so its token columns
    come out of Arrow as int64 tensors (the values that converting its lists of ints
    gives, about ten times faster). Meant for the default collation only: a user's
    collate function gets the rows in the format the user chose."""
    hf = sys.modules.get("datasets")  # not imported: the dataset cannot be one of its
    if hf is None or not isinstance(dataset, hf.Dataset):
        return dataset
    return dataset.with_format("torch") if dataset.format["type"] is None else dataset
