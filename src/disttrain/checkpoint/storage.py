"""The on-disk protocol that makes a save atomic and a load safe.

    run_dir/checkpoints/step-00000120/     committed checkpoint (index.json + shards)
    run_dir/checkpoints/step-00000150.tmp-0/  a save in progress (staging)
    run_dir/checkpoints/latest            name of the newest committed checkpoint

A save: every rank writes its shard into the staging directory (fsync'd) and then a
small ``rank-NNNNN.json`` marker describing what it wrote. Rank 0 waits for every
marker, writes ``index.json``, renames staging to its final name, and only then points
``latest`` at it. The pointer is the commit: a crash or failed write at any earlier
moment leaves the previous checkpoint as ``latest``, intact. Directories newer than the
pointer are leftovers of an interrupted save and are ignored (and removed). A rank
whose write fails (a full disk) leaves ``rank-NNNNN.failed`` instead of its marker; rank
0's commit sees it and gives up, and the staging directory is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

from ..errors import CheckpointRejected
from ..faults import maybe_fail
from ..fsutil import fsync_dir
from ..names import CHECKPOINT_INDEX_FILE, CHECKPOINT_LATEST_FILE
from .format import SAFETENSORS_DTYPES, CheckpointIndex, TensorEntry, shard_file_name
from .integrity import check_files, read_index

_CHUNK = 64 * 2**20
# in the order safetensors.torch.save lays tensors out (by dtype, then by name): every
# tensor stays aligned to its element size, and files match what it writes byte for byte
_ST_ORDER = {dtype: i for i, dtype in enumerate(SAFETENSORS_DTYPES)}


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir(root: Path, step: int, attempt: int) -> Path:
    return root / f"{step_name(step)}.tmp-{attempt}"


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Give an ``OSError`` raised while writing ``path`` the file's name (a failed
    ``write`` or ``fsync``, e.g. a full disk, carries none)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    with naming(tmp):
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


def write_shard(staging: Path, rank: int, tensors: dict[str, torch.Tensor],
                step: int) -> dict[str, Any]:
    """Write this rank's tensors (contiguous, on the CPU) as one safetensors file; return
    its name, size and sha256. The file is streamed from the tensors' own memory after
    a header built here, with no serialised copy in between."""
    maybe_fail("save.before_tensors", rank, step)
    name = shard_file_name(rank)
    with naming(staging / name):
        size, sha256 = _write_hashed(staging / name, _safetensors_pieces(tensors), rank,
                                     step)
    return {"file": name, "bytes": size, "sha256": sha256}


def _write_hashed(path: Path, pieces: list[memoryview], rank: int, step: int
                  ) -> tuple[int, str]:
    """Write ``pieces`` one after another and fsync, hashing them on a second thread
    meanwhile (hashlib releases the GIL on large buffers); returns (bytes, sha256 hex).
    The ``save.mid_file`` fault fires once the header and the first chunk are flushed."""
    digest = hashlib.sha256()
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sha256-r{rank}")
    try:
        with open(path, "wb") as fh:
            for i, piece in enumerate(pieces):
                hashed = hasher.submit(digest.update, piece)  # run in order: one worker
                fh.write(piece)
                if i == min(1, len(pieces) - 1):
                    fh.flush()
                    maybe_fail("save.mid_file", rank, step)
            fh.flush()
            os.fsync(fh.fileno())
            size = fh.tell()
        hashed.result()
    finally:
        hasher.shutdown(wait=True, cancel_futures=True)
    return size, digest.hexdigest()


def _safetensors_pieces(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """A safetensors file as consecutive buffers: the header, then each tensor's bytes
    in chunks of at most ``_CHUNK``, viewing the tensors' memory (no copy)."""
    if sys.byteorder != "little":  # safetensors is little-endian: let it swap the bytes
        data = memoryview(safetensors_bytes(tensors))
        return [data[s:s + _CHUNK] for s in range(0, len(data), _CHUNK)]
    order = sorted(tensors, key=lambda n: (_ST_ORDER.get(tensors[n].dtype, -1), n))
    pieces = [memoryview(_safetensors_header(tensors, order))]
    for name in order:
        # numpy's stubs declare ndarray.__buffer__ for Python >= 3.12 only
        raw = memoryview(tensor_bytes(tensors[name]))  # type: ignore[arg-type]
        pieces += [raw[s:s + _CHUNK] for s in range(0, len(raw), _CHUNK)]
    return pieces


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The memory of a contiguous CPU tensor as a flat uint8 array (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _safetensors_header(tensors: dict[str, torch.Tensor], order: list[str]) -> bytes:
    """The 8-byte little-endian header length, then the JSON header, space-padded so
    that the data starts 8-byte aligned."""
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"checkpoint tensor {name} must be contiguous on the CPU "
                             f"(is on {t.device}, contiguous={t.is_contiguous()})")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _safetensors_dtype(name, t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _safetensors_dtype(name: str, dtype: torch.dtype) -> str:
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"checkpoint tensor {name} has dtype {dtype}, which checkpoints "
                         f"do not store (use one of {sorted(map(str, SAFETENSORS_DTYPES))})")
    return SAFETENSORS_DTYPES[dtype]


def marker_file(staging: Path, rank: int) -> Path:
    """Where ``rank`` says it has written its part of the save."""
    return staging / f"rank-{rank:05d}.json"


def write_marker(staging: Path, rank: int, file_meta: dict[str, Any] | None,
                 entries: dict[str, TensorEntry]) -> None:
    payload = {"rank": rank, "file": file_meta,
               "tensors": {k: v.to_json() for k, v in entries.items()}}
    write_atomic(marker_file(staging, rank), json.dumps(payload).encode())


def failure_marker(staging: Path, rank: int) -> Path:
    return staging / f"rank-{rank:05d}.failed"


def mark_failed(staging: Path, rank: int, problem: str) -> None:
    """Tell rank 0's commit that this rank's part of the save failed (best effort: on a
    full disk the message may not fit, but an empty file still says it)."""
    try:
        fd = os.open(failure_marker(staging, rank), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, problem.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


class SaveAbandoned(Exception):
    """Another rank's part of the save failed; the staging directory is removed."""


def _wait_markers(staging: Path, world_size: int, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    paths = [marker_file(staging, r) for r in range(world_size)]
    while not all(p.exists() for p in paths):
        failed = sorted(staging.glob("rank-*.failed"))
        if failed:
            raise SaveAbandoned(f"checkpoint {staging.name}: {failed[0].name} (another "
                                "rank's write failed)")
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(paths) if not p.exists()]
            raise TimeoutError(f"checkpoint {staging.name}: ranks {missing} did not finish "
                               f"writing within {timeout_s:.0f}s; the save was abandoned")
        time.sleep(0.01)
    return [json.loads(p.read_text()) for p in paths]


def merge_markers(markers: list[dict[str, Any]]) -> tuple[dict[str, TensorEntry],
                                                          dict[str, dict[str, Any]]]:
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, dict[str, Any]] = {}
    for m in markers:
        if m["file"] is not None:
            files[m["file"]["file"]] = {"bytes": m["file"]["bytes"],
                                        "sha256": m["file"]["sha256"]}
        for name, raw in m["tensors"].items():
            entry = TensorEntry.from_json(raw)
            if name in tensors:
                tensors[name].shards += entry.shards
            else:
                tensors[name] = entry
    return tensors, files


def commit(root: Path, staging: Path, step: int, world_size: int, meta: dict[str, Any],
           keep: int, timeout_s: float = 600.0) -> Path:
    """Rank 0: turn a fully written staging directory into the latest checkpoint."""
    markers = _wait_markers(staging, world_size, timeout_s)
    tensors, files = merge_markers(markers)
    index = CheckpointIndex(step=step, tensors=tensors, files=files, meta=meta)
    write_atomic(staging / CHECKPOINT_INDEX_FILE, index.to_json().encode())
    for m in staging.glob("rank-*.json"):
        m.unlink()
    maybe_fail("save.before_rename", 0, step)
    final = root / step_name(step)
    if final.exists():  # an uncommitted leftover of the same step
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_dir(root)
    maybe_fail("save.before_pointer", 0, step)
    write_atomic(root / CHECKPOINT_LATEST_FILE, final.name.encode())
    prune(root, keep)
    return final


def committed_steps(root: Path) -> list[Path]:
    """Committed checkpoint directories, newest first (none newer than ``latest``)."""
    pointer = root / CHECKPOINT_LATEST_FILE
    if not pointer.is_file():
        return []
    newest = pointer.read_text().strip()
    dirs = [p for p in root.glob("step-*") if p.is_dir() and ".tmp-" not in p.name]
    return sorted((p for p in dirs if p.name <= newest), reverse=True)


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` committed checkpoints; drop uncommitted leftovers."""
    committed = committed_steps(root)
    for old in committed[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    newest = committed[0].name if committed else ""
    for p in root.glob("step-*"):
        if p.is_dir() and ".tmp-" not in p.name and p.name > newest:
            shutil.rmtree(p, ignore_errors=True)


def remove_staging(root: Path) -> None:
    for p in root.glob("step-*.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def verify(directory: Path) -> str | None:
    """None if the checkpoint passes every check of :mod:`.validate` (each file's size
    and sha256 included), else what is wrong, naming the file."""
    try:
        check_files(directory, read_index(directory), checksums=True)
    except CheckpointRejected as exc:
        return str(exc)
    return None


def newest_intact(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest committed checkpoint that passes :func:`verify`; each one skipped on
    the way is reported through ``warn`` (one line, naming the file at fault)."""
    for directory in committed_steps(root):
        problem = verify(directory)
        if problem is None:
            return directory
        warn(f"checkpoint {directory.name} rejected: {problem}")
    return None
