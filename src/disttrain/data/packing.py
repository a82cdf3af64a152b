"""Packing: examples of varying length concatenated into rows of ``seq_len`` tokens,
attention kept inside each example (``data.packing``).

An *example* is a mapping with ``input_ids`` [L] and ``labels`` [L] (unshifted, -100
where not trained), L <= ``seq_len``. :class:`PackedExamples` turns a dataset of them
into one of rows, which depend on the lengths and the seed only, never on the number of
ranks; :class:`PackedCollate` stacks rows into the batch the model takes. Each trained
token keeps the target, position and keys it has alone, so the summed loss and the
trained-token count are the unpacked run's. The user's view:
``docs/guides/finetune.md``, "Pack examples into full rows".
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError
from ..names import DOCUMENT_IDS, POSITION_IDS
from ..targets import LABEL_IGNORE_INDEX
from .sampler import GlobalOrderSampler
from .samples import fetch_samples

INPUT_IDS, LABELS = "input_ids", "labels"
PAD_ID = 0  # any id in the vocabulary: padding is never a target and never read by a token
_READ_CHUNK = 1024  # examples fetched per call while reading their lengths


def read_example(sample: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [L], labels [L]) of dataset sample ``index``, int64; refused
    (:class:`~disttrain.errors.DataError`, one line) when it is not an example."""
    if not isinstance(sample, Mapping) or INPUT_IDS not in sample:
        got = (f"a mapping of {', '.join(map(str, sample)) or 'nothing'}"
               if isinstance(sample, Mapping) else f"a {type(sample).__name__}")
        raise DataError(f"sample {index} is {got}: data.packing packs examples, mappings "
                        f"with '{INPUT_IDS}' and '{LABELS}' (set data.packing = false for "
                        "samples of any other kind)")
    try:
        ids = torch.as_tensor(sample[INPUT_IDS])
        labels = torch.as_tensor(sample.get(LABELS, sample[INPUT_IDS]))
    except (TypeError, ValueError, RuntimeError) as e:
        raise DataError(f"sample {index}: its {INPUT_IDS} / {LABELS} are not sequences of "
                        f"integers ({e}); give each as a list or a 1-D tensor") from None
    floats = ids.numel() > 0 and (ids.is_floating_point() or labels.is_floating_point())
    if ids.dim() != 1 or labels.shape != ids.shape or floats:
        raise DataError(f"sample {index}: {INPUT_IDS} {tuple(ids.shape)} and {LABELS} "
                        f"{tuple(labels.shape)} must be 1-D integer sequences of one length "
                        "(one example each, unpadded)")
    return ids.long(), labels.long()


@runtime_checkable
class KnownLengths(Protocol):
    """A dataset of examples that knows every example's length without reading its
    tokens: ``lengths[i]`` of example ``i`` (:class:`~.examples.ExampleDataset`'s int64
    [N]). Each row checks them against the examples it reads."""

    lengths: Any

    def __len__(self) -> int: ...


def example_lengths(examples: Any, seq_len: int) -> list[int]:
    """Every example's length: the dataset's own (:class:`KnownLengths`), else each
    example read once and checked. Refused (one line) past ``seq_len`` tokens, the
    length of a row."""
    n = len(examples)
    if isinstance(examples, KnownLengths):
        lengths = [int(length) for length in examples.lengths]
        if len(lengths) != n:
            raise ValueError(f"a dataset of {n} examples gives {len(lengths)} lengths")
        for i, length in enumerate(lengths):
            _check_fits(i, length, seq_len)
        return lengths
    lengths = []
    for start in range(0, n, _READ_CHUNK):
        indices = list(range(start, min(start + _READ_CHUNK, n)))
        for i, sample in zip(indices, fetch_samples(examples, indices), strict=True):
            length = len(read_example(sample, i)[0])
            _check_fits(i, length, seq_len)
            lengths.append(length)
    return lengths


def _check_fits(index: int, length: int, seq_len: int) -> None:
    if length > seq_len:
        raise DataError(f"example {index} has {length} tokens, more than a packed row "
                        f"holds (model.seq_len={seq_len}): shorten or drop it, or raise "
                        "model.seq_len")


def pack_lengths(lengths: Sequence[int], capacity: int, seed: int) -> list[list[int]]:
    """Rows of example indices, each row's lengths summing to at most ``capacity``
    (best fit). Empty examples are left out: they hold no token.

    Longest first, equal lengths in the order epoch 0 of the global sample order for
    ``seed`` gives them; each goes to the open row with the least room that still holds
    it, else opens a row. Computed once: the rows are the samples each epoch shuffles."""
    order = GlobalOrderSampler(len(lengths), seed).permutation(0).tolist() if lengths else []
    order.sort(key=lambda i: -lengths[i])  # stable: equal lengths keep the seeded order
    rows: list[list[int]] = []
    rows_with: dict[int, list[int]] = {}  # room left -> the open rows with that room
    rooms: list[int] = []  # the keys of rows_with, ascending
    for i in order:
        need = lengths[i]
        if need <= 0:
            continue
        at = bisect_left(rooms, need)
        if at == len(rooms):  # no open row holds it: a new one
            room, row = capacity, len(rows)
            rows.append([])
        else:
            room = rooms[at]
            row = rows_with[room].pop()
            if not rows_with[room]:
                del rows_with[room]
                rooms.pop(at)
        rows[row].append(i)
        left = room - need
        if left > 0:
            if left not in rows_with:
                insort(rooms, left)
                rows_with[left] = []
            rows_with[left].append(row)
    return rows


def packed_row(examples: Sequence[tuple[torch.Tensor, torch.Tensor]], seq_len: int
               ) -> dict[str, torch.Tensor]:
    """One row of ``examples`` ((input_ids, labels) pairs, together at most ``seq_len``
    tokens), padded to ``seq_len``: ``input_ids``, ``labels``, ``position_ids`` and
    ``document_ids``, each int64 [seq_len]. For examples ``e_0 .. e_{n-1}`` of lengths
    ``L_k``, one after the other, then padding:

    - ``input_ids``: the examples' ids, then 0;
    - ``labels``: each example's labels with its first set to -100 (the loss shifts:
      alone it is never a target, packed ``e_{k-1}``'s last token would predict it),
      then -100;
    - ``position_ids``: 0 .. L_k - 1 for each example (and 0 .. on the padding);
    - ``document_ids``: k on ``e_k``, n on the padding (a document of its own)."""
    used = sum(len(ids) for ids, _ in examples)
    if used > seq_len:
        raise ValueError(f"{used} tokens do not fit a row of {seq_len}")
    pad = seq_len - used
    labels = [lab.clone() for _, lab in examples]
    for lab in labels:
        lab[:1] = LABEL_IGNORE_INDEX  # never a target alone (the shift drops it)
    return {
        INPUT_IDS: torch.cat([*(ids for ids, _ in examples),
                              torch.full((pad,), PAD_ID, dtype=torch.long)]),
        LABELS: torch.cat([*labels, torch.full((pad,), LABEL_IGNORE_INDEX, dtype=torch.long)]),
        POSITION_IDS: torch.cat([*(torch.arange(len(ids)) for ids, _ in examples),
                                 torch.arange(pad)]),
        DOCUMENT_IDS: torch.cat([*(torch.full((len(ids),), k, dtype=torch.long)
                                   for k, (ids, _) in enumerate(examples)),
                                 torch.full((pad,), len(examples), dtype=torch.long)]),
    }


class PackedExamples(Dataset):
    """A map-style dataset of rows packed from ``examples``:
    row ``r`` is :func:`packed_row` of the examples :func:`pack_lengths` put in it.
    Construction reads every example's length (:func:`example_lengths`); a row reads its
    examples when asked for."""

    def __init__(self, examples: Any, seq_len: int, seed: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.examples, self.seq_len = examples, seq_len
        self.lengths = example_lengths(examples, seq_len)
        rows = pack_lengths(self.lengths, seq_len, seed)
        if not rows:
            raise DataError(f"the {len(self.lengths)} example(s) hold no token: nothing to "
                            "pack (give examples with input_ids)")
        # row r's examples: members[starts[r]:starts[r + 1]]
        self.members = np.asarray([i for row in rows for i in row], dtype=np.int64)
        self.starts = np.cumsum([0, *(len(row) for row in rows)])

    def __len__(self) -> int:
        return len(self.starts) - 1

    def row_examples(self, row: int) -> list[int]:
        """The indices (in ``examples``) of the examples in row ``row``, in row order."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for {len(self)} packed rows")
        return self.members[self.starts[row]:self.starts[row + 1]].tolist()

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        indices = self.row_examples(row)
        parts = [read_example(s, i) for i, s in
                 zip(indices, fetch_samples(self.examples, indices), strict=True)]
        for i, (ids, _) in zip(indices, parts, strict=True):
            if len(ids) != self.lengths[i]:
                raise DataError(f"example {i} changed length since it was packed "
                                f"({self.lengths[i]} -> {len(ids)} tokens): a dataset "
                                "packed must give the same example every time")
        return packed_row(parts, self.seq_len)

    @property
    def tokens(self) -> int:
        """Tokens of real content over all rows (the padding left out)."""
        return int(sum(self.lengths))


@dataclass(frozen=True)
class PackedCollate:
    """Rows (:class:`PackedExamples`' samples) -> the batch the model takes:
    ``input_ids`` and ``labels`` [B, seq_len] and the inputs the model takes packed
    rows through (its spec's ``packed_inputs``: ``position_ids``, ``document_ids``)."""

    inputs: tuple[str, ...]

    def __call__(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        keys = (INPUT_IDS, *self.inputs, LABELS)
        return {k: torch.stack([row[k] for row in rows]) for k in keys}
