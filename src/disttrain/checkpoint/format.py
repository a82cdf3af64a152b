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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..names import CHECKPOINT_INDEX_FILE

FORMAT = "disttrain-checkpoint"
VERSION = 1

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


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

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "key": self.key}
        if self.flat is not None:
            out["flat"] = list(self.flat)
        else:
            out["offsets"], out["shape"] = list(self.offsets), list(self.shape)
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
    """Everything in ``index.json``."""

    step: int
    tensors: dict[str, TensorEntry]
    files: dict[str, dict[str, Any]]       # file name -> {"sha256", "bytes"}
    meta: dict[str, Any]                   # layout, sampler position, config, ...

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "step": self.step,
                           "meta": self.meta, "files": self.files,
                           "tensors": {k: v.to_json() for k, v in self.tensors.items()}},
                          indent=1, sort_keys=True)

    @staticmethod
    def read(directory: Path) -> CheckpointIndex:
        path = directory / CHECKPOINT_INDEX_FILE
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} v{VERSION} index")
        return CheckpointIndex(step=int(data["step"]), meta=data["meta"], files=data["files"],
                               tensors={k: TensorEntry.from_json(v)
                                        for k, v in data["tensors"].items()})


class ShardReader:
    """Reads tensors from a checkpoint directory's shard files (opened once each)."""

    def __init__(self, directory: Path, index: CheckpointIndex) -> None:
        self.directory, self.index = directory, index
        self._open: dict[str, Any] = {}

    def _file(self, name: str) -> Any:
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
        for ref in entry.shards:
            piece = self._file(ref.file).get_tensor(ref.key)
            if ref.flat is not None:
                out.view(-1)[ref.flat[0]:ref.flat[1]] = piece.reshape(-1)
            else:
                box = tuple(slice(o, o + n) for o, n in zip(ref.offsets, ref.shape))
                out[box] = piece.reshape(ref.shape)
            covered += piece.numel()
        if covered < out.numel():
            raise ValueError(f"checkpoint tensor {name} is only partly stored "
                             f"({covered} of {out.numel()} elements)")
        return out
