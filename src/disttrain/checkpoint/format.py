"""The checkpoint format: safetensors shard files plus one JSON index.

A checkpoint directory holds ``index.json`` and one ``shard-rNNNNN.safetensors`` file per
rank that owned something. The index describes every tensor by its global name, global
shape and dtype, and where its pieces lie:

    "tensors": {
      "model/blocks.0.mlp.up.weight": {
        "shape": [512, 128], "dtype": "float32",
        "shards": [{"file": "shard-r00001.safetensors", "key": "model/blocks.0.mlp.up.weight",
                    "offsets": [0, 0], "shape": [512, 128]}]}}

A shard is a box of the global tensor (``offsets`` per dimension, ``shape``), which
covers whole replicas, row/column slices (tensor parallelism) and pipeline stages; or a
``flat`` range ``[start, stop)`` of the row-major flattening, which covers ZeRO's flat
buffers. Loading assembles any region from whatever shards cover it, so a checkpoint
saved in one layout loads into any other. Nothing is ever unpickled: the index is JSON
and the tensors are safetensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import CheckpointRejected
from ..names import CHECKPOINT_INDEX_FILE

FORMAT = "disttrain-checkpoint"
VERSION = 1

# safetensors' dtype codes for the dtypes checkpoints store, in the order
# safetensors.torch.save lays tensors out (by dtype, then by name)
SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32",
                      torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# the dtypes a checkpoint may hold, by the name the index gives them
DTYPES = {dtype_name(d): d for d in SAFETENSORS_DTYPES}


def dtype_from_name(name: str) -> torch.dtype:
    return DTYPES[name]


def shard_file_name(rank: int) -> str:
    return f"shard-r{rank:05d}.safetensors"


@dataclass(frozen=True)
class ShardRef:
    """Where one piece of a global tensor is stored."""

    file: str
    key: str
    offsets: tuple[int, ...] | None = None  # box: start per dimension
    shape: tuple[int, ...] | None = None    # box: extent per dimension
    flat: tuple[int, int] | None = None     # or a range of the flattened tensor

    @property
    def numel(self) -> int:
        """Elements in this piece."""
        return self.flat[1] - self.flat[0] if self.flat is not None else math.prod(self.box()[1])

    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, shape) of a piece stored as a box (one without ``flat``)."""
        if self.offsets is None or self.shape is None:
            raise ValueError(f"shard {self.key!r} of {self.file} has neither a flat range "
                             "nor a box (offsets and shape)")
        return self.offsets, self.shape

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "key": self.key}
        if self.flat is not None:
            out["flat"] = list(self.flat)
        else:
            offsets, shape = self.box()
            out["offsets"], out["shape"] = list(offsets), list(shape)
        return out

    @staticmethod
    def from_json(d: dict[str, Any]) -> ShardRef:
        if "flat" in d:
            return ShardRef(d["file"], d["key"], flat=tuple(d["flat"]))
        return ShardRef(d["file"], d["key"], offsets=tuple(d["offsets"]),
                        shape=tuple(d["shape"]))


@dataclass
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    shards: list[ShardRef] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype,
                "shards": [s.to_json() for s in self.shards]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> TensorEntry:
        return TensorEntry(tuple(d["shape"]), d["dtype"],
                           [ShardRef.from_json(s) for s in d["shards"]])


def whole_tensor_entry(tensor: torch.Tensor, file: str, key: str) -> TensorEntry:
    """The entry for a tensor stored whole in one file."""
    shape = tuple(tensor.shape)
    return TensorEntry(shape, dtype_name(tensor.dtype),
                       [ShardRef(file, key, offsets=(0,) * len(shape), shape=shape)])


@dataclass
class CheckpointIndex:
    """Everything in ``index.json`` (read it with :func:`.validate.read_index`, which
    checks it)."""

    step: int
    tensors: dict[str, TensorEntry]
    files: dict[str, dict[str, Any]]       # file name -> {"sha256", "bytes"}
    meta: dict[str, Any]                   # layout, sampler position, config, ...

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "step": self.step,
                           "meta": self.meta, "files": self.files,
                           "tensors": {k: v.to_json() for k, v in self.tensors.items()}},
                          indent=1, sort_keys=True)


class ShardReader:
    """Reads tensors from a checkpoint directory's shard files (opened once each). The
    index and the files' headers must have passed :mod:`.validate` (``open_checkpoint``
    does that); a piece that still disagrees with the index is refused, not cast."""

    def __init__(self, directory: Path, index: CheckpointIndex) -> None:
        self.directory, self.index = directory, index
        self._open: dict[str, Any] = {}
        self.wanted: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self.bytes_read = 0

    def want(self, boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> None:
        """Read only the pieces that overlap these (global offsets, sizes) boxes of each
        ``model/<name>`` (and of the optimizer state of that parameter's shape): what
        this rank holds. :meth:`tensor` then returns the whole shape with only those
        parts filled."""
        self.wanted = dict(boxes)

    def _wanted(self, name: str, shape: tuple[int, ...]) -> list | None:
        key = name  # optim/<parameter>/<key>: the parameter's boxes
        if name.startswith("optim/"):
            key = "model/" + name[len("optim/"):].rpartition("/")[0]
        boxes = self.wanted.get(key)
        if not boxes or any(tuple(sizes) == tuple(shape) for _, sizes in boxes) or \
                any(len(o) != len(shape) for o, _ in boxes):
            return None
        return boxes

    def _file(self, name: str) -> Any:
        if name not in self.index.files or Path(name).name != name:
            raise CheckpointRejected(self.directory / CHECKPOINT_INDEX_FILE,
                                     f"shard file {name!r} is not in the index's file list")
        if name not in self._open:
            self._open[name] = safe_open(str(self.directory / name), framework="pt")
        return self._open[name]

    def names(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.index.tensors if k.startswith(prefix))

    def shape(self, name: str) -> tuple[int, ...]:
        """The global shape of tensor ``name``, from the index (nothing is read)."""
        return tuple(self.index.tensors[name].shape)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole global tensor ``name``, assembled from its shards."""
        entry = self.index.tensors[name]
        out = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
        covered = 0
        wanted = self._wanted(name, tuple(entry.shape))
        for ref in entry.shards:
            if wanted is not None and ref.offsets is not None and not any(
                    _overlap(*ref.box(), o, n) for o, n in wanted):
                continue  # a part another rank holds
            piece = self._file(ref.file).get_tensor(ref.key)
            self.bytes_read += piece.numel() * piece.element_size()
            if piece.dtype != out.dtype or piece.numel() != ref.numel:
                raise CheckpointRejected(self.directory / ref.file,
                                         f"tensor {ref.key!r} is {piece.dtype} x "
                                         f"{piece.numel()}, the index says {out.dtype} x "
                                         f"{ref.numel}")
            if ref.flat is not None:
                out.view(-1)[ref.flat[0]:ref.flat[1]] = piece.reshape(-1)
            else:
                offsets, sizes = ref.box()
                box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
                out[box] = piece.reshape(sizes)
            covered += piece.numel()
        if wanted is None and covered < out.numel():
            raise ValueError(f"checkpoint tensor {name} is only partly stored "
                             f"({covered} of {out.numel()} elements)")
        return out


def _overlap(a_offsets: Sequence[int], a_sizes: Sequence[int], b_offsets: Sequence[int],
             b_sizes: Sequence[int]) -> bool:
    """Whether box a and box b (offsets and sizes per dimension, the same number of
    dimensions) intersect."""
    return all(ao < bo + bn and bo < ao + an
               for ao, an, bo, bn in zip(a_offsets, a_sizes, b_offsets, b_sizes, strict=True))
