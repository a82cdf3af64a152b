"""SIGTERM to the launcher: the workers finish their step, save, and the launcher exits
143; the resumed run ends where an uninterrupted one does. SIGINT with
checkpoint.on_signal=exit: 130, nothing saved."""

from __future__ import annotations

import os
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
TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
        "--set", "model.seq_len=32", "--set", "train.eval_samples=16",
        "--set", "train.global_batch=8", "--set", "train.warmup_steps=2",
        "--set", "train.log_every=1", "--set", "train.steps=60",
        "--set", "checkpoint.every=0", "--quiet"]


def _train(run_dir: Path, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([DISTTRAIN, "train", "--nproc", "2", *TINY, *extra, "--set",
                             f"data.path={run_dir.parent / 'text'}", "--run-dir",
                             str(run_dir)], env=env, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err


def _logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def _setup(tmp_path: Path) -> dict:
    """The environment for the launcher, and a small corpus (prepared in no time)."""
    env = dict(os.environ, DISTTRAIN_CACHE=str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    text = tmp_path / "text"
    text.mkdir()
    for i in range(20):
        (text / f"{i}.txt").write_text(" ".join(f"word{i * j % 97}" for j in range(400)))
    return env


def _signal_after(proc: subprocess.Popen, run_dir: Path, signum: int, steps: int) -> None:
    deadline = time.monotonic() + 90
    while _logged_steps(run_dir) < steps and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)


def test_sigint_with_on_signal_exit_stops_at_once_with_130_and_saves_nothing(tmp_path):
    env = _setup(tmp_path)
    run_dir = tmp_path / "run"
    proc = _train(run_dir, env, "--set", "checkpoint.on_signal=exit")
    _signal_after(proc, run_dir, signal.SIGINT, 3)
    code, err = _finish(proc)
    assert code == 130, err[-3000:]
    assert "stopped by SIGINT" in err and "Traceback" not in err
    assert 3 <= _logged_steps(run_dir) < 60
    assert not (run_dir / "checkpoints" / "latest").exists()
    assert not (run_dir / "model.safetensors").exists()


def test_sigterm_saves_the_current_step_exits_143_and_resumes_exactly(tmp_path):
    env = _setup(tmp_path)
    reference = tmp_path / "reference"
    reference_of_cli_run(reference, [*TINY, "--set", f"data.path={tmp_path / 'text'}"], 2,
                         env["DISTTRAIN_CACHE"])

    run_dir = tmp_path / "run"
    proc = _train(run_dir, env)
    _signal_after(proc, run_dir, signal.SIGTERM, 3)
    code, err = _finish(proc)
    assert code == 143, err[-3000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    stopped = _logged_steps(run_dir)
    assert 3 <= stopped < 60
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:08d}"

    code, err = _finish(_train(run_dir, env))
    assert code == 0, err[-3000:]
    assert f"resuming from step-{stopped:08d}" in err
    final, expected = (load_file(str(d / "model.safetensors")) for d in (run_dir, reference))
    assert final.keys() == expected.keys()
    for name in final:
        torch.testing.assert_close(final[name], expected[name], atol=1e-6, rtol=0)
