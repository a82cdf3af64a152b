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
