"""LR schedule and optimizer parameter groups."""

from __future__ import annotations

import math

import pytest

from disttrain.config import load_config, resolve
from disttrain.models import GPT
from disttrain.train.optim import build_optimizer, lr_at


def _train(**values):
    return load_config(values={"train": {"steps": 100, "warmup_steps": 10, "lr": 1.0,
                                         "min_lr_ratio": 0.1, **values}}).train


def test_warmup_is_linear_and_reaches_the_peak():
    t = _train()
    assert [lr_at(s, t, 1.0) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])


@pytest.mark.parametrize("schedule,mid", [("cosine", 0.55), ("linear", 0.55),
                                          ("constant", 1.0)])
def test_decay_ends_at_the_floor(schedule, mid):
    t = _train(schedule=schedule)
    last = lr_at(99, t, 1.0)
    assert last == pytest.approx(1.0 if schedule == "constant" else 0.1)
    halfway = 10 + (99 - 10) / 2
    assert lr_at(int(halfway), t, 1.0) == pytest.approx(mid, abs=0.02)
    assert all(lr_at(s + 1, t, 1.0) <= lr_at(s, t, 1.0) + 1e-12 for s in range(10, 99))
    assert not math.isnan(last)


def test_linear_scaling_rule():
    cfg = load_config(values={"train": {"lr": 0.1, "lr_scaling": "linear", "base_batch": 32,
                                        "global_batch": 128}})
    assert resolve(cfg, 2).lr == pytest.approx(0.4)


def test_weight_decay_only_on_matrices():
    cfg = load_config(values={"model": {"n_layer": 1, "d_model": 16, "n_head": 2}})
    opt = build_optimizer(GPT(cfg.model), cfg.train, 1e-3)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.train.weight_decay and no_decay["weight_decay"] == 0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
