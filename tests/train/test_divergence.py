"""Non-finite steps (train.on_nonfinite) and non-finite config values.

A tiny regression model turns its output into nan at a chosen training forward on a
chosen rank, so the step that goes bad is known exactly.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from disttrain.checkpoint import find_checkpoint, open_checkpoint
from disttrain.cli import main
from disttrain.config import load_config
from disttrain.errors import EXIT_USAGE, ConfigError, DivergenceError
from disttrain.testing import run_distributed

STEPS = 8


class Pairs(Dataset):
    """(x, y) with y a fixed linear function of x."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class NanAt(nn.Module):
    """A linear layer whose output is nan at training forward ``bad`` (1-based) on
    ``rank`` (None: every rank)."""

    def __init__(self, bad: int, rank: int | None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.bad, self.rank, self.calls = bad, rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if self.training:
            self.calls += 1
            here = self.rank is None or self.rank == int(os.environ.get("RANK", "0"))
            if self.calls == self.bad and here:
                out = out * float("nan")
        return out


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _fit(run_dir: str, bad: int, rank: int | None, policy: str, async_save: bool = False):
    """Train NanAt; (what fit raised or None, the optimizer's step count, weights)."""
    from disttrain import Trainer

    torch.manual_seed(0)
    cfg = {"train": {"steps": STEPS, "global_batch": 4, "lr": 0.01, "warmup_steps": 0,
                     "log_every": 1, "on_nonfinite": policy},
           "checkpoint": {"every": 2, "keep": 1, "async": async_save},
           "monitor": {"peak_tflops": 1.0}}  # no peak measurement
    trainer = Trainer(NanAt(bad, rank), Pairs(), _mse, cfg, run_dir=run_dir,
                      flops_per_token=1, progress=False)
    try:
        trainer.fit()
        raised = None
    except DivergenceError as exc:
        raised = (exc.step, exc.what, str(exc))
    steps = [int(s["step"]) for s in trainer.optimizer.state.values()]
    return raised, steps, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _strict_json_lines(path) -> list[dict]:
    def refuse(token: str) -> None:
        raise ValueError(f"{path.name} holds {token}, which is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("async_save", [False, True])
def test_stop_names_the_step_and_keeps_the_last_finite_checkpoint(tmp_path, async_save):
    results = run_distributed(_fit, 2, args=(str(tmp_path), 5, None, "stop", async_save),
                              timeout=60)
    for raised, _, _ in results:  # every rank stops at the same step, for the same reason
        assert raised is not None and raised[:2] == (5, "loss and gradients")
        assert "step 5" in raised[2]
    found = find_checkpoint(tmp_path, warn=pytest.fail)
    assert found.name == "step-00000004"  # keep=1: the one before the bad step, not pruned
    reader = open_checkpoint(found).reader
    assert all(torch.isfinite(t).all() for t in map(reader.tensor, reader.names())
               if t.is_floating_point())
    assert not (tmp_path / "model.safetensors").exists()  # no final weights from it
    assert [r["step"] for r in _strict_json_lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))


def test_skip_drops_the_step_on_every_rank_and_goes_on(tmp_path):
    # only rank 1's loss is nan: both ranks must skip the update and stay equal
    results = run_distributed(_fit, 2, args=(str(tmp_path), 3, 1, "skip"), timeout=60)
    (raised0, steps0, state0), (raised1, steps1, state1) = results
    assert raised0 is None and raised1 is None
    assert steps0 == steps1 and set(steps0) == {STEPS - 1}  # one update skipped
    for k in state0:
        assert torch.isfinite(state0[k]).all()
        torch.testing.assert_close(state0[k], state1[k], atol=0, rtol=0)
    records = {r["step"]: r for r in _strict_json_lines(tmp_path / "metrics.jsonl")}
    assert records[3]["loss"] is None and records[3]["nonfinite_skipped"] == 1
    assert math.isfinite(records[STEPS]["loss"]) and records[STEPS]["nonfinite_skipped"] == 1
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=pytest.fail)
    assert summary["nonfinite_skipped"] == 1 and math.isfinite(summary["final_train_loss"])


@pytest.mark.parametrize("key", ["train.lr", "train.weight_decay", "train.grad_clip"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_config_refuses_non_finite_numbers(key, value, capsys):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"{key}=.*finite"):
        load_config(values={section: {name: float(value)}})
    assert main(["train", "--set", f"{key}={value}"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "finite" in err
