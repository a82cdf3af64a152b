"""A stop on purpose is recorded against torchrun's restarts however the worker was
started: ``disttrain train`` (tests/cli/test_exit_codes.py) or a script calling
``Trainer.fit`` (here): the next attempt stops at once with the same exit code instead
of doing the same again (a divergence, a replica group left behind)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from disttrain import Trainer
from disttrain.errors import EXIT_DIVERGED, DivergenceError, TrainingStopped
from disttrain.names import METRICS_FILE, STOPPED_FILE
from disttrain.parallel.ft.replicas import ReplicaLeftBehind
from disttrain.train.rundir import earlier_stop, stops_once


class Pairs(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), float(i)), torch.ones(1)


class NanFromStepTwo(nn.Module):
    """A linear layer whose training output is nan from its second training forward:
    step 1 is logged, step 2 diverges."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        return self.lin(x) * (float("nan") if self.calls >= 2 else 1.0)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _attempt(monkeypatch: pytest.MonkeyPatch, number: int) -> None:
    """This process as attempt ``number`` of a torchrun worker allowed 2 restarts."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(number))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.delenv("RANK", raising=False)  # rank 0


def _fit(run_dir) -> None:
    cfg = {"train": {"steps": 3, "global_batch": 4, "warmup_steps": 0, "log_every": 1},
           "monitor": {"peak_tflops": 1.0}}
    Trainer(NanFromStepTwo(), Pairs(), _mse, cfg, run_dir=run_dir, flops_per_token=1,
            progress=False).fit()


def test_trainer_fit_records_its_stop_and_the_restart_stops_at_once(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    _attempt(monkeypatch, 0)
    with pytest.raises(DivergenceError):
        _fit(tmp_path)
    assert earlier_stop(tmp_path) == EXIT_DIVERGED
    records = (tmp_path / METRICS_FILE).read_text()
    _attempt(monkeypatch, 1)
    with pytest.raises(TrainingStopped, match=r"not restarting \(restart 1\)") as stop:
        _fit(tmp_path)
    assert stop.value.exit_code == EXIT_DIVERGED
    assert (tmp_path / METRICS_FILE).read_text() == records  # nothing trained again
    _attempt(monkeypatch, 0)  # a new launch forgets the stop and trains (and diverges)
    with pytest.raises(DivergenceError):
        _fit(tmp_path)


def test_a_replica_group_left_behind_is_recorded(tmp_path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _attempt(monkeypatch, 1)
    with pytest.raises(ReplicaLeftBehind), stops_once(tmp_path):
        raise ReplicaLeftBehind(1, 2.0)
    assert earlier_stop(tmp_path) == ReplicaLeftBehind.exit_code
    _attempt(monkeypatch, 2)  # torchrun's last restart: refused before anything runs
    with pytest.raises(TrainingStopped, match=r"not restarting \(restart 2\)"), \
            stops_once(tmp_path):
        pytest.fail("the attempt ran")
    (tmp_path / STOPPED_FILE).unlink()  # the last attempt (2 of 2 restarts): no
    _attempt(monkeypatch, 2)  # restart follows, nothing is recorded
    with pytest.raises(ReplicaLeftBehind), stops_once(tmp_path):
        raise ReplicaLeftBehind(1, 2.0)
    assert earlier_stop(tmp_path) is None
