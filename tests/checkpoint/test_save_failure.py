"""A save that cannot be written (a full disk) stops training with one line, leaves no
staging directory and does not touch the previous checkpoint."""

from __future__ import annotations

import errno
import json
import os

import pytest
from support import fit_tiny

from disttrain.checkpoint import find_checkpoint, storage
from disttrain.checkpoint.format import shard_file_name
from disttrain.errors import CheckpointSaveError
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check


def _fit_with_full_disk(run_dir: str, async_save: bool, full_at: int, on_rank: int):
    """fit_tiny, saving every 2 steps, where ``on_rank``'s shard write of step
    ``full_at`` fails as a full disk does; the CheckpointSaveError's text, or None."""
    real = storage._write_hashed

    def write(path, pieces, rank, step):
        if step == full_at and rank == on_rank:
            with open(path, "wb") as fh:  # a partial file, then the disk is full
                fh.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, pieces, rank, step)

    storage._write_hashed = write
    try:
        fit_tiny(10, run_dir, checkpoint={"every": 2, "keep": 2, "async": async_save},
                 peak_tflops=1.0, log_every=1)
    except CheckpointSaveError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_stops_with_one_line_and_keeps_the_previous_checkpoint(tmp_path,
                                                                         async_save):
    messages = run_distributed(_fit_with_full_disk, 2, args=(str(tmp_path), async_save, 4, 1),
                               timeout=60)
    assert messages[0] == messages[1]  # every rank stops, with the failing rank's line
    line = messages[0]
    assert line is not None and "\n" not in line
    staged = storage.staging_dir(tmp_path / "checkpoints", 4, 0) / shard_file_name(1)
    for part in ("rank 1", str(staged), "No space left on device"):
        assert part in line
    root = tmp_path / "checkpoints"
    assert not list(root.glob("*.tmp-*"))  # the staging directory is gone
    assert find_checkpoint(tmp_path, warn=pytest.fail).name == "step-00000002"
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert not (tmp_path / "model.safetensors").exists()
    # reported at once (sync) or at a step boundary before the next save (async)
    logged = [json.loads(line)["step"] for line in
              (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == 3 if not async_save else logged[-1] in (4, 5)


def _mount_tmpfs(where: str, size_kib: int) -> bool:
    """Mount a tmpfs of ``size_kib`` at ``where``; False where this process may not."""
    import subprocess

    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs",
                           where], capture_output=True, timeout=30)
    return done.returncode == 0


def _fit_on(run_dir: str, steps: int) -> str | None:
    try:
        fit_tiny(steps, run_dir, checkpoint={"every": 2, "keep": 2}, peak_tflops=1.0,
                 log_every=1)
    except CheckpointSaveError as exc:
        return str(exc)
    return None


def _refused_on(run_dir: str) -> str:
    from disttrain.errors import UserError

    with pytest.raises(UserError) as caught:
        fit_tiny(2, run_dir, peak_tflops=1.0)
    return str(caught.value)


@pytest.mark.parametrize("room_kib", [64, 4])
def test_a_really_full_filesystem(tmp_path, room_kib):
    """The same on a real filesystem that fills up: a small tmpfs (root only). With
    4 KiB left the metrics file may fill up too (its records then wait in memory)."""
    import shutil
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if not _mount_tmpfs(str(mount), 8 * 1024):
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    try:
        run_dir = mount / "run"
        assert run_distributed(_fit_on, 2, args=(str(run_dir), 2), timeout=60) == [None] * 2
        saved = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*")
                    if f.is_file())
        # fill the disk, leaving room for the metrics but not for another checkpoint
        free = shutil.disk_usage(mount).free
        with open(mount / "filler", "wb") as fh:
            fh.write(b"\0" * max(0, free - min(saved // 2, room_kib * 1024)))
        messages = run_distributed(_fit_on, 2, args=(str(run_dir), 6), timeout=60)
        assert messages[0] == messages[1] and messages[0] is not None
        assert "\n" not in messages[0] and "No space left on device" in messages[0]
        root = run_dir / "checkpoints"
        assert not list(root.glob("*.tmp-*"))  # the staging directory is gone
        assert (root / "latest").read_text().strip() == "step-00000002"
        assert find_checkpoint(run_dir, warn=pytest.fail).name == "step-00000002"
        # with no byte left, a new run is refused on every rank before training
        with open(mount / "filler", "ab") as fh:
            try:
                fh.write(b"\0" * shutil.disk_usage(mount).free)
                fh.flush()
            except OSError:
                pass
        refused = run_distributed(_refused_on, 2, args=(str(mount / "new"),), timeout=60)
        assert refused[0] == refused[1] and "\n" not in refused[0]
        assert "cannot write the run directory" in refused[0]
        assert "No space left on device" in refused[0]
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30)
