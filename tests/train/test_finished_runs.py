"""A run directory whose run reached ``train.steps`` stays finished: ``disttrain train
--run-dir`` and ``Trainer.fit`` say so and change no file; raising train.steps continues
it. The run's outputs all get the same file mode."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import disttrain.launch.agent
from disttrain.checkpoint.stream import write_streamed
from disttrain.cli import main
from disttrain.names import CONFIG_FILE, SUMMARY_FILE, WEIGHTS_FILE
from disttrain.testing import run_distributed
from disttrain.train import rundir
from disttrain.train.checkpointing import finished_run


def _fit(run_dir: str, steps: int, every: int = 2) -> dict:
    from disttrain import Trainer

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    data = list(zip(x, x.sum(dim=1, keepdim=True), strict=False))
    cfg = {"train": {"steps": steps, "global_batch": 4, "warmup_steps": 0, "log_every": 1},
           "checkpoint": {"every": every, "keep": 1, "async": False},
           "monitor": {"peak_tflops": 1.0, "tensorboard": False}}
    trainer = Trainer(nn.Linear(4, 1), data, F.mse_loss, cfg, run_dir=run_dir,
                      flops_per_token=1, progress=False)
    return trainer.fit()


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root``: its hash, size and modification time."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                       p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    [summary] = run_distributed(_fit, 1, args=(str(run_dir), 4), timeout=120)
    assert summary["steps"] == 4 and summary["start_step"] == 0
    return run_dir


def test_the_launcher_leaves_a_finished_run_untouched(finished, monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(disttrain.launch.agent, "launch",
                        lambda *a, **k: pytest.fail("a finished run was launched"))
    before = snapshot(finished)
    # the config comes from the run directory's snapshot: train.steps = 4
    assert main(["train", "--run-dir", str(finished), "--nproc", "1"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "finished run" in lines[0], lines
    assert "step 4" in lines[0] and "train.steps=8" in lines[0]
    assert snapshot(finished) == before


def test_fit_on_a_finished_run_returns_its_summary_and_writes_nothing(finished):
    before = snapshot(finished)
    [summary] = run_distributed(_fit, 1, args=(str(finished), 4), timeout=120)
    assert summary == json.loads((finished / SUMMARY_FILE).read_text())
    assert snapshot(finished) == before


def test_raising_the_steps_continues_a_finished_run(finished, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    [summary] = run_distributed(_fit, 1, args=(str(run_dir), 6), timeout=120)
    assert (summary["start_step"], summary["steps"]) == (4, 6)


def test_a_run_that_stopped_before_its_final_weights_is_not_finished(finished, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    (run_dir / SUMMARY_FILE).unlink()  # checkpointed at step 4, then killed
    assert finished_run(run_dir, 4, warn=lambda _: None) is None
    assert finished_run(finished, 4, warn=lambda _: None) is not None


def test_a_run_without_checkpoints_is_finished_by_its_summary(tmp_path):
    rundir.write_summary(tmp_path, {"steps": 5})
    line = finished_run(tmp_path, 5, warn=lambda _: None)
    assert line is not None and "no checkpoint" in line and "new --run-dir" in line
    assert finished_run(tmp_path, 6, warn=lambda _: None) is None
    assert finished_run(tmp_path / "empty", 1, warn=lambda _: None) is None


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_weights_have_the_mode_of_the_other_outputs(tmp_path, umask):
    old = os.umask(umask)
    try:
        rundir.write_text_atomic(tmp_path / CONFIG_FILE, "")
        write_streamed(tmp_path / WEIGHTS_FILE, [("w", (2,), torch.float32)],
                       lambda _: torch.ones(2))
    finally:
        os.umask(old)
    modes = {stat.S_IMODE((tmp_path / f).stat().st_mode) for f in (CONFIG_FILE, WEIGHTS_FILE)}
    assert modes == {0o666 & ~umask}
