"""Fetching a micro-batch's samples: one batched call where the dataset has one, the
rows of a Hugging Face ``datasets.Dataset`` as tensors for the default collation."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, Subset

from disttrain.data import fetch_samples, tensor_rows
from disttrain.train.batch import collate_samples


class _Indexed(Dataset):
    """A map-style dataset that records how it is read."""

    def __init__(self, n: int = 10) -> None:
        self.n, self.calls = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.calls.append(("item", i))
        return {"input_ids": torch.full((3,), i)}


class _Batched(_Indexed):
    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        self.calls.append(("items", list(indices)))
        return [{"input_ids": torch.full((3,), i)} for i in indices]


def test_a_dataset_with_getitems_is_read_in_one_call_in_order():
    data = _Batched()
    samples = fetch_samples(data, [7, 2, 5])
    assert data.calls == [("items", [7, 2, 5])]
    assert [int(s["input_ids"][0]) for s in samples] == [7, 2, 5]


def test_a_plain_map_style_dataset_is_indexed_per_sample():
    data = _Indexed()
    samples = fetch_samples(data, [7, 2, 5])
    assert data.calls == [("item", 7), ("item", 2), ("item", 5)]
    assert [int(s["input_ids"][0]) for s in samples] == [7, 2, 5]
    assert [s["input_ids"].tolist() for s in fetch_samples(list(samples), [2, 0])] == [
        [5] * 3, [7] * 3]


def test_a_subset_passes_the_batched_call_through():
    data = _Batched()
    samples = fetch_samples(Subset(data, [9, 8, 7, 6]), [3, 0])
    assert data.calls == [("items", [6, 9])]
    assert [int(s["input_ids"][0]) for s in samples] == [6, 9]


def _rows(n: int = 12, seq: int = 5) -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50_000, (n, seq), generator=g)
    return {"input_ids": ids.tolist(), "labels": torch.where(ids % 3 == 0, -100, ids).tolist(),
            "attention_mask": (ids % 5 != 0).long().tolist()}


def test_a_hf_dataset_batch_equals_the_same_rows_given_as_a_list():
    datasets = pytest.importorskip("datasets", reason="the datasets library is not installed")
    columns = _rows()
    ds = datasets.Dataset.from_dict(columns)
    as_list = [{k: v[i] for k, v in columns.items()} for i in range(len(ds))]
    indices = [11, 0, 4, 4, 7]
    want = collate_samples([as_list[i] for i in indices])
    for view in (ds, tensor_rows(ds)):
        got = collate_samples(fetch_samples(view, indices))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype == torch.int64
            assert torch.equal(got[k], want[k]), k


def test_tensor_rows_views_only_a_default_format_hf_dataset_in_torch_format():
    datasets = pytest.importorskip("datasets", reason="the datasets library is not installed")
    ds = datasets.Dataset.from_dict(_rows())
    view = tensor_rows(ds)
    assert view.format["type"] == "torch" and ds.format["type"] is None
    assert isinstance(view[0]["input_ids"], torch.Tensor)
    chosen = ds.with_format("numpy")
    assert tensor_rows(chosen) is chosen  # a format the user chose is kept
    plain = _Indexed()
    assert tensor_rows(plain) is plain


def test_samples_that_do_not_stack_name_the_entry_and_the_fix():
    with pytest.raises(ValueError, match="'text'.*remove_columns"):
        collate_samples([{"text": "ab", "input_ids": [1]}, {"text": "cd", "input_ids": [2]}])
    with pytest.raises(ValueError, match="'input_ids'.*pad"):
        collate_samples([{"input_ids": [1, 2]}, {"input_ids": [3]}])
