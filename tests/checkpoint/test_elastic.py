"""Elastic restarts: a worker killed with SIGKILL costs only the steps since the last
checkpoint; the restarted group resumes by itself and ends where an uninterrupted run
ends."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import reference_of_cli_run

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))
ARGS = ["--nproc", "2", "--quiet", "--set", "model.n_layer=1", "--set", "model.d_model=32",
        "--set", "model.n_head=2", "--set", "model.seq_len=32", "--set", "train.global_batch=8",
        "--set", "train.eval_samples=8", "--set", "train.steps=120",
        "--set", "checkpoint.every=10"]


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    return {**env, "DISTTRAIN_CACHE": str(cache)}


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def _worker_with_rank(launcher: int, rank: int) -> int | None:
    for child in _children(launcher):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return child
    return None


def _wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_sigkill_one_worker_restarts_and_matches_uninterrupted(tmp_path):
    env = _env(tmp_path / "cache")
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    reference_of_cli_run(ref_dir, ARGS, 2, env["DISTTRAIN_CACHE"])

    proc = subprocess.Popen([DISTTRAIN, "train", *ARGS, "--max-restarts", "2",
                             "--run-dir", str(run_dir)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "latest").exists(), 120)
        time.sleep(random.Random(7).uniform(0.0, 0.3))  # somewhere after a checkpoint
        victim = _worker_with_rank(proc.pid, 1)
        assert victim is not None, "no worker with RANK=1 found"
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # take the workers down with the launcher
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resuming from step-" in stderr

    expected = load_file(str(ref_dir / "model.safetensors"))
    actual = load_file(str(run_dir / "model.safetensors"))
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6)
