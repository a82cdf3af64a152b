"""The optimizer step gated on the device (issue 38): for every built-in optimizer, a
step whose flag says non-finite leaves every parameter and every optimizer state tensor
exactly as it was, and a step whose flag is clear is bit for bit the ungated step."""

from __future__ import annotations

import math

import pytest
import torch
from support import tiny_config

from disttrain.parallel.registry import OPTIMIZER_REGISTRY
from disttrain.parallel.strategy import OptimizerContext
from disttrain.train.optim import step_unless

# 1-bit Adam needs a dp group; its gate is tested end to end in test_onebit_adam
BUILT_IN = ["adamw", "sgd", "lars", "lamb"]


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g))]


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    train = tiny_config(optimizer=name, momentum=0.9).train
    groups = [{"params": params[:1], "weight_decay": 0.1},
              {"params": params[1:], "weight_decay": 0.0}]
    return OPTIMIZER_REGISTRY.get(name).build(OptimizerContext(groups=groups, lr=1e-2, train=train,
                                                       replicas=None))


def _grads(params: list[torch.nn.Parameter], seed: int, poison: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    if poison:
        params[0].grad[1, 2] = math.nan


def _snapshot(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer
              ) -> list[torch.Tensor]:
    state = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in [*params, *state]]


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_flagged_step_changes_nothing_and_a_clear_one_is_the_plain_step(name):
    gated, plain = _params(), _params()
    opt_g, opt_p = _optimizer(name, gated), _optimizer(name, plain)
    assert getattr(opt_g, "_step_supports_amp_scaling", False), name  # gated on device
    for seed in (1, 2):  # two good steps: the state exists and has moved
        _grads(gated, seed)
        _grads(plain, seed)
        step_unless(opt_g, torch.tensor(0.0))
        opt_p.step()
    before = _snapshot(gated, opt_g)
    _grads(gated, 3, poison=True)
    step_unless(opt_g, torch.tensor(1.0))  # the flag the step computes on the device
    for old, now in zip(before, _snapshot(gated, opt_g), strict=True):
        assert torch.equal(old, now), name
    _grads(gated, 4)
    _grads(plain, 4)
    step_unless(opt_g, torch.tensor(0.0))
    opt_p.step()
    for a, b in zip(_snapshot(gated, opt_g), _snapshot(plain, opt_p), strict=True):
        assert torch.equal(a, b), name


def test_a_first_step_skipped_leaves_sgd_momentum_as_a_fresh_start():
    """torch's fused SGD makes momentum buffers from the first gradient; a first step
    skipped on the device must not leave them uninitialised."""
    skipped, fresh = _params(), _params()
    opt_s, opt_f = _optimizer("sgd", skipped), _optimizer("sgd", fresh)
    _grads(skipped, 1, poison=True)
    step_unless(opt_s, torch.tensor(1.0))
    for seed in (2, 3):
        _grads(skipped, seed)
        _grads(fresh, seed)
        step_unless(opt_s, torch.tensor(0.0))
        opt_f.step()
    for a, b in zip(_snapshot(skipped, opt_s), _snapshot(fresh, opt_f), strict=True):
        assert torch.equal(a, b)
