"""A checkpoint directory is untrusted input: it is checked completely before use.

Every file name the index gives must be a plain name that resolves inside the checkpoint
directory, and every shard's file must be in the index's file list (so it has a size
and a checksum). The index's shapes, dtypes and shard boxes must be sane (non-negative,
known dtypes, boxes inside their tensor) and agree with each file's own safetensors
header, whose offsets must tile the file's bytes exactly; a tensor's stored elements must
cover its global shape (each stored piece counted once), which bounds every allocation
by the bytes on disk. Nothing is allocated, and no file is opened, before the checks it
depends on have passed. A failure is a :class:`~disttrain.errors.CheckpointRejected`
naming the file and the reason, in one line.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

from ..errors import CheckpointRejected
from ..names import CHECKPOINT_INDEX_FILE
from .format import (
    DTYPES,
    FORMAT,
    SAFETENSORS_DTYPES,
    VERSION,
    CheckpointIndex,
    ShardRef,
    TensorEntry,
    dtype_name,
)

_MAX_INDEX_BYTES = 256 * 2**20
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_MAX_DIMS = 32
_CHUNK = 64 * 2**20
# safetensors dtype code -> (dtype name as the index writes it, bytes per element)
_HEADER_DTYPES = {code: (dtype_name(d), d.itemsize)
                  for d, code in SAFETENSORS_DTYPES.items()}


def member(directory: Path, name: object, what: str) -> Path:
    """``directory / name`` for a plain file name that resolves (symbolic links
    followed) inside ``directory``; anything else is rejected before it is touched."""
    index = directory / CHECKPOINT_INDEX_FILE
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name
            or "\\" in name or "\0" in name):
        raise CheckpointRejected(index, f"{what} {name!r} is not a plain file name in the "
                                        "checkpoint directory")
    path = directory / name
    try:
        inside = path.resolve().parent == directory.resolve()
    except (OSError, RuntimeError):  # a symbolic-link loop, a name too long
        inside = False
    if not inside:
        raise CheckpointRejected(index, f"{what} {name!r} resolves outside the checkpoint "
                                        "directory")
    return path


def read_index(directory: Path) -> CheckpointIndex:
    """The index of ``directory``, every field checked (not yet against the files)."""
    path = member(directory, CHECKPOINT_INDEX_FILE, "index")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise CheckpointRejected(path, f"unreadable index ({exc.strerror or exc})") from None
    if len(raw) > _MAX_INDEX_BYTES:
        raise CheckpointRejected(path, f"index larger than {_MAX_INDEX_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except ValueError as exc:
        raise CheckpointRejected(path, f"index is not JSON ({exc})") from None
    return _index_from_json(directory, path, data)


def _index_from_json(directory: Path, path: Path, data: Any) -> CheckpointIndex:
    if not isinstance(data, dict):
        raise CheckpointRejected(path, f"index is a JSON {type(data).__name__}, not an object")
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointRejected(path, f"not a {FORMAT} v{VERSION} index")
    step = _count(path, data.get("step"), "step")
    meta = _dict(path, data.get("meta"), "meta")
    for key in ("position", "world_size"):
        if key in meta:
            _count(path, meta[key], f"meta.{key}")
    files = {name: _file_info(directory, path, name, info)
             for name, info in _dict(path, data.get("files"), "files").items()}
    tensors = {name: _entry(directory, path, name, raw, files)
               for name, raw in _dict(path, data.get("tensors"), "tensors").items()}
    return CheckpointIndex(step=step, tensors=tensors, files=files, meta=meta)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names no key twice (readers disagree on which one wins)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice in one object")
    return out


def _dict(path: Path, value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointRejected(path, f"{what} is {type(value).__name__}, not an object")
    return value


def _count(path: Path, value: Any, what: str) -> int:
    """A non-negative JSON integer (not a bool, not a float)."""
    if type(value) is not int or value < 0:
        raise CheckpointRejected(path, f"{what} is {value!r}, not a non-negative integer")
    return value


def _counts(path: Path, value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS:
        raise CheckpointRejected(path, f"{what} is {value!r}, not a list of at most "
                                       f"{_MAX_DIMS} non-negative integers")
    return tuple(_count(path, v, what) for v in value)


def _file_info(directory: Path, path: Path, name: str, info: Any) -> dict[str, Any]:
    member(directory, name, "file")
    info = _dict(path, info, f"files[{name!r}]")
    sha = info.get("sha256")
    if not (isinstance(sha, str) and len(sha) == 64
            and all(c in "0123456789abcdef" for c in sha)):
        raise CheckpointRejected(path, f"file {name!r} has no valid sha256 ({sha!r})")
    return {"bytes": _count(path, info.get("bytes"), f"files[{name!r}].bytes"),
            "sha256": sha}


def _entry(directory: Path, path: Path, name: str, raw: Any,
           files: dict[str, Any]) -> TensorEntry:
    raw = _dict(path, raw, f"tensor {name}")
    shape = _counts(path, raw.get("shape"), f"tensor {name} shape")
    if not isinstance(raw.get("dtype"), str) or raw["dtype"] not in DTYPES:
        raise CheckpointRejected(path, f"tensor {name} has unknown dtype {raw.get('dtype')!r}"
                                       f" (known: {', '.join(sorted(DTYPES))})")
    shards = raw.get("shards")
    if not isinstance(shards, list) or not shards:
        raise CheckpointRejected(path, f"tensor {name} lists no shards")
    return TensorEntry(shape, raw["dtype"],
                       [_shard(directory, path, name, shape, s, files) for s in shards])


def _shard(directory: Path, path: Path, name: str, shape: tuple[int, ...], raw: Any,
           files: dict[str, Any]) -> ShardRef:
    raw = _dict(path, raw, f"a shard of tensor {name}")
    file, key = raw.get("file"), raw.get("key")
    member(directory, file, f"shard file of tensor {name}")
    if file not in files:
        raise CheckpointRejected(path, f"shard file {file!r} of tensor {name} is not in the "
                                       "index's file list (it has no checksum)")
    if not isinstance(key, str):
        raise CheckpointRejected(path, f"a shard of tensor {name} has key {key!r}")
    if "flat" in raw:
        flat = _counts(path, raw["flat"], f"tensor {name} flat range")
        if len(flat) != 2 or not flat[0] <= flat[1] <= math.prod(shape):
            raise CheckpointRejected(path, f"tensor {name} flat range {list(flat)} is not "
                                           f"inside its {math.prod(shape)} elements")
        return ShardRef(file, key, flat=flat)
    offsets = _counts(path, raw.get("offsets"), f"tensor {name} shard offsets")
    extent = _counts(path, raw.get("shape"), f"tensor {name} shard shape")
    if len(offsets) != len(shape) or len(extent) != len(shape) or any(
            o + n > d for o, n, d in zip(offsets, extent, shape, strict=True)):
        raise CheckpointRejected(path, f"tensor {name} shard box {list(offsets)}+"
                                       f"{list(extent)} is not inside its shape {list(shape)}")
    return ShardRef(file, key, offsets=offsets, shape=extent)


def check_files(directory: Path, index: CheckpointIndex, *, checksums: bool) -> None:
    """Check every listed file (its size, its sha256 if ``checksums``, its safetensors
    header) and every shard against the header of its file."""
    headers = {}
    for name, info in sorted(index.files.items()):
        path = member(directory, name, "file")
        try:
            headers[name] = _check_file(path, info, checksums)
        except OSError as exc:
            raise CheckpointRejected(path, f"unreadable ({exc.strerror or exc})") from None
    used: set[tuple[str, str]] = set()
    for name, entry in sorted(index.tensors.items()):
        _check_entry(directory, name, entry, headers)
        for ref in entry.shards:  # a piece counted twice could hide a hole in a tensor
            if (ref.file, ref.key) in used:
                raise CheckpointRejected(directory / ref.file, f"tensor {ref.key!r} is "
                                                               "listed as two shards")
            used.add((ref.file, ref.key))


def _check_file(path: Path, info: dict[str, Any], checksums: bool
                ) -> dict[str, tuple[str, int]]:
    if not path.is_file():
        raise CheckpointRejected(path, "missing")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise CheckpointRejected(path, f"{size} bytes, expected {info['bytes']} (truncated?)")
    if checksums and _sha256(path) != info["sha256"]:
        raise CheckpointRejected(path, "checksum mismatch (corrupted)")
    return read_header(path, size)


def _check_entry(directory: Path, name: str, entry: TensorEntry,
                 headers: dict[str, dict[str, tuple[str, int]]]) -> None:
    stored = 0
    for ref in entry.shards:
        path = directory / ref.file
        if ref.key not in headers[ref.file]:
            raise CheckpointRejected(path, f"has no tensor {ref.key!r} (index: {name})")
        dtype, numel = headers[ref.file][ref.key]
        if dtype != entry.dtype:
            raise CheckpointRejected(path, f"tensor {ref.key!r} is {dtype}, the index says "
                                           f"{entry.dtype}")
        if numel != ref.numel:
            raise CheckpointRejected(path, f"tensor {ref.key!r} has {numel} elements, the "
                                           f"index's shard of {name} {ref.numel}")
        stored += numel
    if stored < math.prod(entry.shape):
        raise CheckpointRejected(directory / entry.shards[0].file,
                                 f"tensor {name} of shape {list(entry.shape)} is only "
                                 f"partly stored ({stored} of {math.prod(entry.shape)} "
                                 "elements)")


def read_header(path: Path, size: int) -> dict[str, tuple[str, int]]:
    """Tensor name -> (dtype name, element count) from a safetensors file's header,
    whose data offsets must match each tensor's bytes and tile the data exactly."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 <= length <= min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointRejected(path, f"not a safetensors file (header length {length}"
                                           f" in a {size}-byte file)")
        try:
            header = json.loads(fh.read(length).decode("utf-8"),
                                object_pairs_hook=_unique_keys)
        except ValueError as exc:
            raise CheckpointRejected(path, f"safetensors header is not JSON ({exc})") \
                from None
    if not isinstance(header, dict):
        raise CheckpointRejected(path, "safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    spans = sorted(_header_tensor(path, key, value) + (key,)
                   for key, value in header.items())
    end = 0
    for begin, stop, _, _, key in spans:
        if begin != end:
            raise CheckpointRejected(path, f"tensor {key!r} data_offsets start at {begin}, "
                                           f"expected {end} (overlapping or gapped data)")
        end = stop
    if end != size - 8 - length:
        raise CheckpointRejected(path, f"tensor data ends at {end}, the file holds "
                                       f"{size - 8 - length} bytes of data")
    return {key: (dtype, numel) for _, _, dtype, numel, key in spans}


def _header_tensor(path: Path, key: str, value: Any) -> tuple[int, int, str, int]:
    """(begin, end, dtype name, element count) of one header entry, all consistent."""
    if not isinstance(value, dict):
        raise CheckpointRejected(path, f"tensor {key!r} is described by {value!r}, not an "
                                       "object")
    code = value.get("dtype")
    if not isinstance(code, str) or code not in _HEADER_DTYPES:
        raise CheckpointRejected(path, f"tensor {key!r} has unknown safetensors dtype "
                                       f"{code!r}")
    dtype, itemsize = _HEADER_DTYPES[code]
    numel = math.prod(_counts(path, value.get("shape"), f"tensor {key!r} shape"))
    offsets = _counts(path, value.get("data_offsets"), f"tensor {key!r} data_offsets")
    if len(offsets) != 2 or offsets[1] - offsets[0] != numel * itemsize:
        raise CheckpointRejected(path, f"tensor {key!r} data_offsets {list(offsets)} do not "
                                       f"span its {numel} x {itemsize} bytes")
    return offsets[0], offsets[1], dtype, numel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
