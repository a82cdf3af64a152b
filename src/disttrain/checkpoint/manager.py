"""Saving and finding checkpoints for a training run.

:meth:`CheckpointManager.save` with ``async`` on copies this rank's owned tensors into
host buffers kept between saves (the only part training waits for), then writes them and
commits on a background thread; the next save first waits for the previous one. GPU
tensors go to pinned host buffers by ``non_blocking`` copies on a side stream that
starts after the work already queued; training's stream waits for the copies' event
before the optimizer changes them (a GPU-side wait: the CPU does not block). With
``async`` off it writes CPU tensors from where they lie, without a copy. Loading picks
the newest committed checkpoint that passes every check of :mod:`.validate` (checksums
included), warning in one line about the ones it skipped.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..names import CHECKPOINT_DIR
from . import storage
from .format import (
    CheckpointIndex,
    ShardReader,
    ShardRef,
    TensorEntry,
    dtype_name,
    shard_file_name,
    whole_tensor_entry,
)
from .integrity import check_files, read_index

# global name, global shape, and where the piece lies: a flat range (start, stop) of the
# row-major flattening, or a box {"offsets": [...], "shape": [...]}
Part = tuple[str, tuple[int, ...], "tuple[int, int] | dict[str, list[int]]"]


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


@dataclass(frozen=True)
class LoadedCheckpoint:
    directory: Path
    index: CheckpointIndex
    reader: ShardReader

    @property
    def step(self) -> int:
        return self.index.step

    @property
    def meta(self) -> dict[str, Any]:
        return self.index.meta


def find_checkpoint(run_dir: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest intact committed checkpoint of ``run_dir`` (each newer one that fails
    a check of :mod:`.validate` is reported through ``warn``); None if there is none at
    all; UserError naming the newest one's fault if every one fails."""
    root = checkpoint_root(run_dir)
    if not storage.committed_steps(root):
        return None
    problems: list[str] = []
    found = storage.newest_intact(root, problems.append)
    more = f" (and {len(problems) - 1} more rejected)" if len(problems) > 1 else ""
    if found is None:
        raise UserError(f"no intact checkpoint in {root}: {problems[0]}{more}; restore "
                        "the files or start a new --run-dir")
    if problems:  # one line, however many were skipped
        warn(f"{problems[0]}{more}; using {found.name} instead")
    return found


def open_checkpoint(directory: Path) -> LoadedCheckpoint:
    """Open a checkpoint for reading after checking its index and every file's header
    (:mod:`.validate`; checksums are :func:`find_checkpoint`'s part)."""
    index = read_index(directory)
    check_files(directory, index, checksums=False)
    return LoadedCheckpoint(directory, index, ShardReader(directory, index))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between CPU tensors a plain single-threaded memcpy instead,
    which is as fast (memory-bound) and, unlike torch's intra-op threads, does not wait
    for a descheduled thread when the machine's cores are oversubscribed."""
    if src.device.type == "cpu" and src.is_contiguous():
        np.copyto(storage.tensor_bytes(dst), storage.tensor_bytes(src))
    else:
        dst.copy_(src)


class CheckpointManager:
    """One per rank. ``keep`` committed checkpoints are kept; ``async_save`` moves the
    writing off the training thread."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, *, keep: int,
                 async_save: bool) -> None:
        self.root = checkpoint_root(run_dir)
        self.rank, self.world_size = rank, world_size
        self.keep, self.async_save = keep, async_save
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._host: dict[str, torch.Tensor] = {}
        self._copied: threading.Event | None = None  # set once the async snapshot is taken
        self._stream: Any = None  # the CUDA side stream device snapshots are copied on
        self._device_copy: Any = None  # (event, source tensors) of the running snapshot

    def prepare(self) -> None:
        """Rank 0, before training: clear leftovers of interrupted saves."""
        if self.rank == 0 and self.root.exists():
            storage.remove_staging(self.root)
            storage.prune(self.root, self.keep)

    def save(self, step: int, tensors: dict[str, torch.Tensor], owners: dict[str, int],
             meta: dict[str, Any], parts: dict[str, Part] | None = None, *,
             eager: frozenset[str] = frozenset(), commit: bool = True) -> None:
        """Save the tensors this rank owns (``owners[key] == rank``). A key in ``parts``
        is a piece of a larger global tensor (a ZeRO shard): ``(global name, global
        shape, flat range)``; any other key is a whole tensor under its own name.

        Asynchronous saves return at once: the background thread first copies the
        tensors into host buffers, then writes. Until that copy is done the tensors
        must not change: call :meth:`before_update` before anything modifies them (the
        trainer does, before each optimizer step, so the copy overlaps the next forward
        and backward). Keys in ``eager`` (tensors that change sooner, e.g. buffers a
        forward pass updates) are copied now.

        A failed write raises :class:`SaveFailed` (asynchronous: from :meth:`wait`),
        one line naming the rank, the file and the error: this rank's files are removed
        and a failure marker makes rank 0's commit give up, so the previous checkpoint
        stays ``latest``; once every rank is done, the caller removes the staging
        directory (:meth:`abandon`). ``commit=False`` (synchronous saves only): write
        this rank's part and return; rank 0 then calls :meth:`commit` once every rank's
        write is known to have succeeded."""
        self.wait()
        mine = {n: t.detach() for n, t in tensors.items() if owners[n] == self.rank}
        staging = storage.staging_dir(self.root, step, self.attempt)
        staging.mkdir(parents=True, exist_ok=True)
        if not self.async_save:  # training waits for the write: CPU tensors in place
            host = {n: t.cpu().contiguous() for n, t in mine.items()}
            self._write(staging, step, host, parts or {})
            if commit and self.rank == 0:
                self.commit(step, meta)
            return
        mine.update({n: mine[n].clone() for n in eager if n in mine})
        on_device = {n: t for n, t in mine.items() if t.is_cuda}
        pinned = self._snapshot_device(on_device) if on_device else {}
        on_host = {n: t for n, t in mine.items() if n not in on_device}
        copied = self._copied = threading.Event()
        self._thread = threading.Thread(target=self._run,
                                        args=(staging, step, on_host, pinned, meta,
                                              parts or {}, copied),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def before_update(self) -> float:
        """Block until the running asynchronous save has its snapshot (the saved tensors
        may change from now on); returns the seconds waited."""
        if self._device_copy is not None:  # the optimizer's kernels queue after the copy
            torch.cuda.current_stream().wait_event(self._device_copy[0])
        copied = self._copied
        if copied is None or copied.is_set():
            return 0.0
        start = time.perf_counter()
        copied.wait()
        return time.perf_counter() - start

    def _copy_to_host(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Snapshot ``mine`` into host buffers kept from the previous save (the previous
        write is finished: save() waited for it). Reusing them is what keeps the stall
        short: fresh memory costs a page fault per 4 KiB on first touch, several times
        the copy itself. The buffers stay allocated between saves (one copy of the
        owned state). GPU tensors take :meth:`_snapshot_device` instead."""
        host: dict[str, torch.Tensor] = {}
        for name, t in mine.items():
            buf = self._host.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype)
            _copy(buf, t)
            host[name] = buf
        self._host = host
        return host

    def _snapshot_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Start copying GPU ``tensors`` into pinned host buffers (reused between saves)
        on the side stream, after everything training has queued so far; the sources
        stay referenced until the copy's event has passed."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        host: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self._stream):
            for name, t in tensors.items():
                buf = self._host.get(name)
                if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                        or not buf.is_pinned()):
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                host[name] = buf
        event = torch.cuda.Event()
        event.record(self._stream)
        self._device_copy = (event, list(tensors.values()))
        return host

    def _run(self, staging: Path, step: int, mine: dict[str, torch.Tensor],
             pinned: dict[str, torch.Tensor], meta: dict[str, Any],
             parts: dict[str, Part], copied: threading.Event) -> None:
        """The background thread of an asynchronous save; ``copied``: set once the
        snapshot is taken (this save's :attr:`_copied`)."""
        try:
            try:
                host = self._copy_to_host(mine)
            finally:  # never leave before_update() waiting, even on an error
                copied.set()
            if self._device_copy is not None:
                self._device_copy[0].synchronize()  # the GPU copies have landed
            host.update(pinned)
            self._host.update(pinned)
            self._write(staging, step, host, parts)
            if self.rank == 0:
                self.commit(step, meta)
        except BaseException as exc:  # surfaced by wait() on the training thread
            self._error = exc

    def _write(self, staging: Path, step: int, host: dict[str, torch.Tensor],
               parts: dict[str, Part]) -> None:
        """This rank's shard and marker; on failure, its files are removed, a failure
        marker tells rank 0, and :class:`SaveFailed` is raised."""
        try:
            self._write_part(staging, step, host, parts)
        except Exception as exc:
            for path in (staging / shard_file_name(self.rank),
                         storage.marker_file(staging, self.rank)):
                path.unlink(missing_ok=True)
            problem = _problem(self.rank, exc)
            storage.mark_failed(staging, self.rank, problem)
            raise SaveFailed(f"checkpoint step {step}: {problem}", own=True) from exc

    def commit(self, step: int, meta: dict[str, Any]) -> None:
        """Rank 0: make the written step the latest checkpoint, or raise
        :class:`SaveFailed` (another rank's write failed: the caller removes the staging
        directory once every rank is done; this one's index failed: removed here)."""
        staging = storage.staging_dir(self.root, step, self.attempt)
        try:
            storage.commit(self.root, staging, step, self.world_size, meta, self.keep)
        except storage.SaveAbandoned as exc:  # other ranks may still be writing: the
            raise SaveFailed(str(exc), own=False) from exc  # caller abandons it later
        except Exception as exc:  # every rank's marker is in: nobody writes there now
            self.abandon(step)
            raise SaveFailed(f"checkpoint step {step}: {_problem(self.rank, exc)}",
                             own=True) from exc

    def abandon(self, step: int) -> None:
        """Remove the staging directory of ``step`` (rank 0, once every rank is done
        with it); ``latest`` and the committed checkpoints are not touched."""
        shutil.rmtree(storage.staging_dir(self.root, step, self.attempt),
                      ignore_errors=True)

    def _write_part(self, staging: Path, step: int, host: dict[str, torch.Tensor],
                    parts: dict[str, Part]) -> None:
        file_meta = storage.write_shard(staging, self.rank, host, step) if host else None
        name = shard_file_name(self.rank)
        entries: dict[str, TensorEntry] = {}
        for key, t in host.items():
            if key not in parts:
                entries[key] = whole_tensor_entry(t, name, key)
                continue
            global_name, shape, where = parts[key]
            entry = entries.setdefault(global_name, TensorEntry(tuple(shape),
                                                                dtype_name(t.dtype)))
            entry.shards.append(
                ShardRef(name, key, offsets=tuple(where["offsets"]),
                         shape=tuple(where["shape"])) if isinstance(where, dict)
                else ShardRef(name, key, flat=(where[0], where[1])))
        storage.write_marker(staging, self.rank, file_meta, entries)

    @property
    def writing(self) -> bool:
        """An asynchronous save is still running on this rank."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> bool:
        """An asynchronous save was started and :meth:`wait` has not collected it."""
        return self._thread is not None

    def wait(self) -> None:
        """Block until the previous save (and, on rank 0, its commit) is done; raise
        :class:`SaveFailed` if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._device_copy = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, SaveFailed):
                raise error
            raise SaveFailed(f"checkpoint save failed: {_problem(self.rank, error)}",
                             own=True) from error


class SaveFailed(Exception):
    """A checkpoint save failed: one line naming the rank, the file and the error.
    ``own``: this rank's part failed (False: rank 0 abandoned the save because
    another rank's did)."""

    def __init__(self, message: str, *, own: bool) -> None:
        super().__init__(message)
        self.own = own


def _problem(rank: int, exc: BaseException) -> str:
    """``rank 1 could not write PATH: No space left on device``, for one line."""
    if isinstance(exc, OSError) and exc.filename:
        return f"rank {rank} could not write {exc.filename}: {exc.strerror or exc}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"rank {rank}: {type(exc).__name__}: {text}"
