"""Prepared instruction and chat examples, one sample per example: :class:`ExampleDataset`.

Its docstring is the contract any batching of these samples may rely on (padding here
in :mod:`.padding`, packing in :mod:`.packing`); the arrays on disk are those
:mod:`.example_cache` writes, memory-mapped on first access.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.targets import LABEL_IGNORE_INDEX

TOKENS, TRAINED, OFFSETS = "tokens.bin", "trained.bin", "offsets.npy"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class PreparedExamples:
    """What preparation found: where the arrays are, each split's size, the ids a model
    must embed (``vocab_needed``: every token and ``pad_id``), the padding id, and the
    examples skipped under ``data.on_bad_example = skip`` (their count, and the first
    few locations with their problem)."""

    directory: Path
    examples: dict[str, int]  # split -> examples
    trained_tokens: dict[str, int]  # split -> trained tokens
    vocab_needed: int
    pad_id: int
    token_dtype: str
    read: int  # examples read, skipped ones included
    skipped: int = 0
    skipped_first: list[str] = field(default_factory=list)

    def dataset(self, split: str) -> ExampleDataset:
        return ExampleDataset(self.directory, split, self.token_dtype)

    def skip_report(self) -> str | None:
        """One line saying what was skipped (None: nothing)."""
        if not self.skipped:
            return None
        more = "; ..." if self.skipped > len(self.skipped_first) else ""
        return (f"data.on_bad_example=skip: skipped {self.skipped} of {self.read} examples "
                f"({'; '.join(self.skipped_first)}{more})")


class ExampleDataset(Dataset):
    """The examples of one split of a prepared directory.

    - ``dataset[i]`` is ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}`` for one
      whole example, ``2 <= L <= model.seq_len`` (longer ones were refused or truncated
      at preparation), in transformers' convention: ``labels`` are *unshifted* (the loss
      shifts: position ``t``'s logits predict ``labels[t + 1]``), equal to ``input_ids``
      where the token is trained on (completion / assistant tokens) and ``-100``
      elsewhere; ``labels[0]`` is always ``-100`` and at least one other label is not.
    - ``dataset.lengths`` is int64 [N], ``L`` of every sample, read without touching any
      token (for a batcher that bins examples by length).
    - No sample carries padding, positions or an attention mask: a batcher adds what its
      layout needs.

    On disk: every example's ids back to back in ``tokens.bin`` (``uint16`` when the
    tokenizer's vocabulary fits, else ``uint32``), one byte per token in ``trained.bin``
    (1: trained), ``offsets.npy`` (int64 [N + 1]: example ``j`` is ``[offsets[j],
    offsets[j + 1])``), and each split's examples, ``train.npy`` and ``val.npy`` (int64,
    ascending). The token maps are dropped when the dataset is pickled."""

    def __init__(self, directory: Path, split: str, dtype: str = "uint16") -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.directory, self.dtype = Path(directory), dtype
        offsets = np.load(self.directory / OFFSETS)
        self._index = np.load(self.directory / f"{split}.npy")
        self._starts = offsets[self._index]
        self.lengths = offsets[self._index + 1] - self._starts
        self._maps: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """``{"input_ids": [L], "labels": [L]}`` (int64) of example ``index``."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"example {index} out of range for {n} examples")
        start = int(self._starts[index])
        stop = start + int(self.lengths[index])
        tokens, trained = self._arrays()
        ids = torch.from_numpy(np.asarray(tokens[start:stop], dtype=np.int64))
        mask = torch.from_numpy(np.asarray(trained[start:stop], dtype=np.bool_))
        return {"input_ids": ids,
                "labels": torch.where(mask, ids, torch.full_like(ids, LABEL_IGNORE_INDEX))}

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._maps is None:
            self._maps = (np.memmap(self.directory / TOKENS, dtype=np.dtype(self.dtype),
                                    mode="r"),
                          np.memmap(self.directory / TRAINED, dtype=np.uint8, mode="r"))
        return self._maps

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None
        return state
