"""LR schedule, optimizer parameter groups, LARS and LAMB."""

from __future__ import annotations

import math

import pytest
import torch

from disttrain.config import load_config
from disttrain.models import GPT
from disttrain.optim import LAMB, LARS, trust_ratio
from disttrain.run_checks import resolve
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


# ---------------------------------------------------------------- LARS / LAMB
def _matrix_and_bias(w: list[list[float]], g: list[list[float]], b: float, gb: float):
    weight = torch.nn.Parameter(torch.tensor(w))
    bias = torch.nn.Parameter(torch.tensor([b]))
    weight.grad, bias.grad = torch.tensor(g), torch.tensor([gb])
    return weight, bias


def test_lars_trust_ratio_by_hand():
    # ||w|| = 5; u = g + 0.5 w = [2.1, 2.8], ||u|| = 3.5; trust = 0.1 * 5 / 3.5 = 1/7,
    # so the scaled update is [0.3, 0.4]; the bias takes plain momentum SGD.
    weight, bias = _matrix_and_bias([[3.0, 4.0]], [[0.6, 0.8]], 1.0, 2.0)
    opt = LARS([{"params": [weight], "weight_decay": 0.5},
                {"params": [bias], "weight_decay": 0.0}],
               lr=1.0, momentum=0.9, trust_coefficient=0.1)
    opt.step()
    torch.testing.assert_close(weight.detach(), torch.tensor([[2.7, 3.6]]))
    torch.testing.assert_close(bias.detach(), torch.tensor([-1.0]))
    # step 2, same gradient: ||w|| = 4.5, u = [0.6, 0.8] + 0.5 w = [1.95, 2.6] (norm 3.25),
    # trust = 0.1 * 4.5 / 3.25; the momentum buffer is 0.9 * [0.3, 0.4] + trust * u
    opt.step()
    u = torch.tensor([[1.95, 2.6]]) * (0.1 * 4.5 / 3.25)
    expected = torch.tensor([[2.7, 3.6]]) - (0.9 * torch.tensor([[0.3, 0.4]]) + u)
    torch.testing.assert_close(weight.detach(), expected)


def test_lamb_trust_ratio_by_hand():
    # first step: m_hat = g, v_hat = g^2, so u = g / (|g| + eps) ~ sign(g) = [1, -1];
    # ||w|| = 5, ||u|| = sqrt(2): w -= lr * 5 / sqrt(2) * [1, -1]
    weight, bias = _matrix_and_bias([[3.0, 4.0]], [[1.0, -2.0]], 1.0, 0.5)
    opt = LAMB([weight, bias], lr=0.1, betas=(0.9, 0.99), eps=0.0)
    opt.step()
    step = 0.1 * 5 / math.sqrt(2)
    torch.testing.assert_close(weight.detach(), torch.tensor([[3.0 - step, 4.0 + step]]))
    torch.testing.assert_close(bias.detach(), torch.tensor([0.9]))  # no trust: lr * 1


def test_trust_ratio_is_one_for_zero_norms():
    assert float(trust_ratio(torch.zeros(2, 2), torch.ones(2, 2))) == 1.0
    assert float(trust_ratio(torch.ones(2, 2), torch.zeros(2, 2))) == 1.0


def _bigram_batch() -> torch.Tensor:
    t = torch.randint(0, 64, (16, 1), generator=torch.Generator().manual_seed(0))
    rows = [t]
    for _ in range(16):
        t = (t * 5 + 3) % 64
        rows.append(t)
    return torch.cat(rows, 1)


@pytest.mark.parametrize("name,lr", [("lars", 0.1), ("lamb", 0.1)])
def test_large_batch_optimizers_lower_the_loss(name, lr):
    from support import TINY_MODEL

    from disttrain.models import token_loss

    cfg = load_config(values={"model": dict(TINY_MODEL),
                              "train": {"optimizer": name, "trust_coefficient": 0.1}})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.train, lr)
    assert isinstance(opt, LARS if name == "lars" else LAMB)
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.train.weight_decay, 0.0]
    tokens = _bigram_batch()
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss_sum, count = token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        (loss_sum / count).backward()
        opt.step()
        losses.append(float(loss_sum.detach() / count))
    assert losses[-1] < 0.9 * losses[0], losses
