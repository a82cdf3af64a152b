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
    ``rank`` (None: every rank); with ``in_buffer``, a buffer the loss does not see goes
    inf instead."""

    def __init__(self, bad: int, rank: int | None, in_buffer: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("seen", torch.zeros(1))
        self.bad, self.rank, self.in_buffer, self.calls = bad, rank, in_buffer, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if self.training:
            self.calls += 1
            here = self.rank is None or self.rank == int(os.environ.get("RANK", "0"))
            if self.calls == self.bad and here:
                if self.in_buffer:
                    self.seen.fill_(math.inf)
                else:
                    out = out * float("nan")
        return out


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _fit(run_dir: str, bad: int, rank: int | None, policy: str, async_save: bool = False,
         in_buffer: bool = False, comm: dict | None = None, **train):
    """Train NanAt; (what fit raised or None, the optimizer's step count, weights)."""
    from disttrain import Trainer

    torch.manual_seed(0)
    cfg = {"train": {"steps": STEPS, "global_batch": 4, "lr": 0.01, "warmup_steps": 0,
                     "log_every": 1, "on_nonfinite": policy, **train},
           "checkpoint": {"every": 2, "keep": 1, "async": async_save},
           "monitor": {"peak_tflops": 1.0},  # no peak measurement
           "comm": comm or {}}
    if train.get("sync") == "async":  # the servers write no checkpoints
        cfg["checkpoint"] = {"every": 0}
    trainer = Trainer(NanAt(bad, rank, in_buffer), Pairs(), _mse, cfg, run_dir=run_dir,
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


def test_a_non_finite_state_is_never_checkpointed(tmp_path):
    # rank 1's buffer goes inf at step 5 while loss and gradients stay finite: the save
    # of step 6 is refused on every rank, and keep=1 still holds step 4
    results = run_distributed(_fit, 2, args=(str(tmp_path), 5, 1, "stop", False, True),
                              timeout=60)
    assert [r[0][:2] for r in results] == [(6, "model state (model/seen)")] * 2
    assert find_checkpoint(tmp_path, warn=pytest.fail).name == "step-00000004"
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))


def test_replicas_that_step_apart_stop_together(tmp_path):
    # local SGD: only rank 1 sees its nan, yet both ranks stop at step 3
    results = run_distributed(_fit, 2, args=(str(tmp_path), 3, 1, "stop"),
                              kwargs={"sync": "local_sgd", "sync_every": 4}, timeout=60)
    assert [r[0][:2] for r in results] == [(3, "loss and gradients")] * 2


def test_a_parameter_server_never_applies_a_non_finite_push(tmp_path):
    # one server, two workers, each worker's third gradient nan. The server takes pushes
    # as they arrive until its budget (8 steps x 2 workers) is spent, so one worker's
    # third push may come after it (the other pushed 14 by then; seen on a loaded CI
    # machine when only one worker's gradient went nan); at least one is always in.
    # stop: every rank raises (the step is the equivalent synchronous one, which depends
    # on arrival order)
    results = run_distributed(_fit, 3, args=(str(tmp_path / "stop"), 3, None, "stop"),
                              kwargs={"sync": "async", "ps_servers": 1}, timeout=60)
    steps = {r[0][0] for r in results}
    assert len(steps) == 1 and 2 <= steps.pop() <= STEPS  # at least 3 pushes were in
    assert {r[0][1] for r in results} == {"loss and gradients"}
    assert not (tmp_path / "stop" / "model.safetensors").exists()
    _strict_json_lines(tmp_path / "stop" / "metrics.jsonl")
    # skip: the pushes are dropped, the run ends with finite weights, the count is reported
    results = run_distributed(_fit, 3, args=(str(tmp_path / "skip"), 3, None, "skip"),
                              kwargs={"sync": "async", "ps_servers": 1}, timeout=60)
    assert all(raised is None for raised, _, _ in results)
    for _, _, state in results:
        assert all(torch.isfinite(t).all() for t in state.values())
    summary = json.loads((tmp_path / "skip" / "summary.json").read_text(),
                         parse_constant=pytest.fail)
    skipped = summary["nonfinite_skipped"]
    assert skipped in (1, 2)  # 2 unless one worker's third push came after the budget
    assert summary["updates"] + summary["dropped"] + skipped == STEPS * 2  # the budget


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


@pytest.mark.parametrize("codec", ["topk", "onebit"])
def test_skip_leaves_no_nan_in_a_codecs_error_feedback(tmp_path, codec):
    # rank 1's step-3 gradients are nan: its residual must not carry them into step 4
    results = run_distributed(_fit, 2, args=(str(tmp_path), 3, 1, "skip"),
                              kwargs={"comm": {"codec": codec, "error_feedback": True}},
                              timeout=60)
    for raised, steps, state in results:
        assert raised is None and set(steps) == {STEPS - 1}  # only step 3 was skipped
        assert all(torch.isfinite(t).all() for t in state.values())
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=pytest.fail)
    assert summary["nonfinite_skipped"] == 1


def test_powersgd_forgets_a_warm_start_a_nan_reached():
    from disttrain.comm.codecs import PowerSGDCodec

    codec = PowerSGDCodec(rank=1, error_feedback=True)
    codec.residuals = {0: torch.tensor([1.0, math.nan, -math.inf])}
    codec.q = {(0, 0): torch.tensor([[math.nan], [1.0]]), (0, 1): torch.ones(2, 1)}
    codec.drop_nonfinite_state()
    assert codec.residuals[0].tolist() == [1.0, 0.0, 0.0]  # the finite part is still owed
    # the poisoned warm start is forgotten: back to the seed's draw, as a fresh Q would be
    drawn = torch.randn(2, 1, generator=codec._generator(torch.device("cpu"), 0, 0))
    assert torch.equal(codec.q[(0, 0)], drawn)
    assert torch.equal(codec.q[(0, 1)], torch.ones(2, 1))  # a finite one is kept


@pytest.mark.parametrize("key", ["train.lr", "train.weight_decay", "train.grad_clip"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_config_refuses_non_finite_numbers(key, value, capsys):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"{key}=.*finite"):
        load_config(values={section: {name: float(value)}})
    assert main(["train", "--set", f"{key}={value}"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "finite" in err


def _fit_gpt_nan_block(run_dir: str, bad: int, layout: dict):
    """The tiny GPT under ``layout`` whose first block's output is nan at training
    forward ``bad``; what DivergenceError said (step, what), or None."""
    from support import SyntheticTokens, tiny_config

    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = tiny_config(None, steps=STEPS, log_every=1, peak_tflops=1.0, **layout)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    calls = []

    def poison(module, _inputs, output):
        if module.training:
            calls.append(1)
            if len(calls) == bad:
                return output * float("nan")
        return None
    model.blocks[0].register_forward_hook(poison)
    try:
        Trainer(model, SyntheticTokens(), token_loss, cfg, run_dir=run_dir,
                collate_fn=collate_token_batch, progress=False).fit()
    except DivergenceError as exc:
        return exc.step, exc.what
    return None


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_model_parallel_ranks_stop_together(tmp_path, layout):
    # the nan starts in block 0: under pp=2 only stage 0 computes it, under tp=2 each
    # shard does; every rank must stop at the same step
    results = run_distributed(_fit_gpt_nan_block, 2, args=(str(tmp_path), 3, layout),
                              timeout=60)
    assert results == [(3, "loss and gradients")] * 2


def test_fp16_gradient_overflow_stays_the_loss_scalers_to_skip():
    from disttrain.errors import nonfinite_what

    # (bad loss, bad gradients, loss scaled) -> what the run calls non-finite
    assert nonfinite_what(False, True, loss_scaled=True) is None  # the scaler skips
    assert nonfinite_what(False, True, loss_scaled=False) == "gradients"
    assert nonfinite_what(True, False, loss_scaled=True) == "loss"
    assert nonfinite_what(True, True, loss_scaled=False) == "loss and gradients"
    assert nonfinite_what(False, False, loss_scaled=False) is None
