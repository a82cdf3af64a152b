"""TokenWindowDataset: windows, shard boundaries, pickling, errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from disttrain.data import TokenWindowDataset, collate_token_batch
from disttrain.errors import DataError


def _write_shards(tmp_path: Path, sizes: list[int]) -> tuple[list[Path], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    paths, arrays = [], []
    for i, n in enumerate(sizes):
        tokens = rng.integers(0, 256, size=n).astype(np.uint16)
        path = tmp_path / f"train_{i:05d}.bin"
        tokens.tofile(path)
        paths.append(path)
        arrays.append(tokens)
    return paths, arrays


def test_windows_are_the_shard_tokens_shifted_by_one(tmp_path: Path) -> None:
    seq_len = 7
    shards, arrays = _write_shards(tmp_path, [50, 8, 3, 21])
    ds = TokenWindowDataset(shards, seq_len)
    assert len(ds) == 50 // 8 + 8 // 8 + 0 + 21 // 8
    expected = [a[j * 8:(j + 1) * 8] for a in arrays for j in range(len(a) // 8)]
    for i, window in enumerate(expected):
        sample = ds[i]
        assert sample["input_ids"].dtype == torch.int64
        assert sample["input_ids"].shape == (seq_len,) == sample["targets"].shape
        assert sample["input_ids"].tolist() == window[:-1].tolist()
        assert sample["targets"].tolist() == window[1:].tolist()
    assert ds[-1]["targets"].tolist() == expected[-1][1:].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_windows_never_cross_shards(tmp_path: Path) -> None:
    # Each shard holds one constant value; a window crossing shards would mix them.
    paths = []
    for i, n in enumerate([10, 13, 9]):
        path = tmp_path / f"s{i}.bin"
        np.full(n, i + 1, dtype=np.uint16).tofile(path)
        paths.append(path)
    ds = TokenWindowDataset(paths, seq_len=3)
    assert len(ds) == 2 + 3 + 2
    owners = [set(ds[i]["input_ids"].tolist()) | set(ds[i]["targets"].tolist())
              for i in range(len(ds))]
    assert owners == [{1}, {1}, {2}, {2}, {2}, {3}, {3}]


def test_pickle_round_trip_after_use(tmp_path: Path) -> None:
    shards, _ = _write_shards(tmp_path, [40, 40])
    ds = TokenWindowDataset(shards, seq_len=4)
    before = [ds[i]["input_ids"] for i in range(len(ds))]
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone) == len(ds)
    for i, tokens in enumerate(before):
        torch.testing.assert_close(clone[i]["input_ids"], tokens)


def test_too_little_data_is_a_data_error(tmp_path: Path) -> None:
    shards, _ = _write_shards(tmp_path, [5, 6])
    with pytest.raises(DataError, match="11 tokens") as info:
        TokenWindowDataset(shards, seq_len=6)
    assert "seq_len" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(DataError):
        TokenWindowDataset([], seq_len=1)


def test_collate_stacks_batches(tmp_path: Path) -> None:
    shards, _ = _write_shards(tmp_path, [100])
    ds = TokenWindowDataset(shards, seq_len=9)
    batch = collate_token_batch([ds[i] for i in (0, 3, 5)])
    assert batch["input_ids"].shape == (3, 9) == batch["targets"].shape
    torch.testing.assert_close(batch["targets"][1], ds[3]["targets"])
    torch.testing.assert_close(batch["input_ids"][:, 1:], batch["targets"][:, :-1])
