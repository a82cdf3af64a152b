"""Fixed-length training windows over token shards: flat files of one integer dtype
(``.bin``; ``uint16`` for the byte corpus) or 1-D ``.npy`` arrays, memory-mapped."""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.errors import DataError


def open_shard(path: Path, dtype: str = "uint16") -> np.ndarray:
    """A shard's tokens, memory-mapped (never read whole): a ``.npy`` file as its own
    1-D array, any other file as flat ``dtype`` values."""
    if Path(path).suffix == ".npy":
        return np.load(path, mmap_mode="r")
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def tokens_per_shard(shards: list[Path], dtype: str = "uint16") -> list[int]:
    """Tokens in each shard file, from its size or its ``.npy`` header (no token is
    read)."""
    itemsize = np.dtype(dtype).itemsize
    return [len(open_shard(s)) if Path(s).suffix == ".npy" else os.path.getsize(s) // itemsize
            for s in shards]


class TokenWindowDataset(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens, each inside one shard.

    Shard ``s`` with ``n_s`` tokens holds ``n_s // (seq_len + 1)`` windows; window ``j``
    covers tokens ``[j * (seq_len + 1), (j + 1) * (seq_len + 1))``. Tokens at a shard's end
    that do not fill a window are dropped. Samples are numbered shard by shard.

    Construction reads file sizes only; shards are memory-mapped on first access, and the
    maps are dropped when pickled (so a dataset crosses process boundaries cheaply).
    """

    def __init__(self, shards: list[Path], seq_len: int, dtype: str = "uint16") -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.shards = [Path(s) for s in shards]
        self.seq_len, self.dtype = seq_len, dtype
        sizes = tokens_per_shard(self.shards, dtype)
        counts = [n // (seq_len + 1) for n in sizes]
        self._ends = np.cumsum(counts).tolist()  # _ends[s] = windows in shards 0..s
        self._maps: dict[int, np.ndarray] = {}  # memory maps (open_shard)
        if not self._ends or self._ends[-1] == 0:
            raise DataError(f"{sum(sizes)} tokens in {len(self.shards)} shard(s) make no "
                            f"window of seq_len+1={seq_len + 1} tokens (seq_len is too large "
                            "or the data too small: lower model.seq_len or add text)")

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """``{"input_ids": [seq_len], "targets": [seq_len]}`` (int64), targets shifted by 1."""
        shard, offset = self._locate(index)
        window = np.asarray(self._map(shard)[offset:offset + self.seq_len + 1], dtype=np.int64)
        tokens = torch.from_numpy(window)
        return {"input_ids": tokens[:-1], "targets": tokens[1:]}

    def _locate(self, index: int) -> tuple[int, int]:
        """(shard, token offset) of sample ``index``."""
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sample {index} out of range for {n} windows")
        shard = bisect.bisect_right(self._ends, index)
        first = self._ends[shard - 1] if shard else 0
        return shard, (index - first) * (self.seq_len + 1)

    def _map(self, shard: int) -> np.ndarray:
        if shard not in self._maps:
            self._maps[shard] = open_shard(self.shards[shard], self.dtype)
        return self._maps[shard]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state


def collate_token_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into ``{"input_ids": [B, T], "targets": [B, T]}``."""
    return {key: torch.stack([s[key] for s in samples]) for key in ("input_ids", "targets")}
