"""SIGTERM to the launcher: the workers finish their step, save, and the launcher exits
143; the resumed run ends where an uninterrupted one does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))
TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
        "--set", "model.seq_len=32", "--set", "train.eval_samples=16",
        "--set", "train.global_batch=8", "--set", "train.warmup_steps=2",
        "--set", "train.log_every=1", "--set", "train.steps=60",
        "--set", "checkpoint.every=0", "--quiet"]


def _train(run_dir: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([DISTTRAIN, "train", "--nproc", "2", *TINY, "--set",
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


def test_sigterm_saves_the_current_step_exits_143_and_resumes_exactly(tmp_path):
    env = dict(os.environ, DISTTRAIN_CACHE=str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    text = tmp_path / "text"  # a small corpus: prepared in no time
    text.mkdir()
    for i in range(20):
        (text / f"{i}.txt").write_text(" ".join(f"word{i * j % 97}" for j in range(400)))
    reference = tmp_path / "reference"
    code, err = _finish(_train(reference, env))
    assert code == 0, err[-3000:]

    run_dir = tmp_path / "run"
    proc = _train(run_dir, env)
    deadline = time.monotonic() + 90
    while _logged_steps(run_dir) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
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
