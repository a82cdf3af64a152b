"""A sync mode and an optimizer-side strategy written here, outside src/, registered the
way the built-ins are, train, checkpoint and resume through the public Trainer: proof
that train/ knows them only through the registry and the declared protocols."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from support import SyntheticTokens, state_of, tiny_config
from test_data_parallel import assert_states_close, reference_train

from disttrain.comm import Communicator
from disttrain.parallel import (
    GradSync,
    OptimizerContext,
    OptimizerKind,
    SyncContext,
    SyncMode,
    register_optimizer,
    register_sync_mode,
)
from disttrain.testing import run_distributed


class AverageEvery:
    """Replicas step on their own gradients and average their parameters every
    ``every`` steps and after the last (plain local SGD, written from scratch)."""

    steps_apart = True

    def __init__(self, ctx: SyncContext) -> None:
        self.params = [p for p in ctx.model.parameters() if p.requires_grad]
        self.comm: Communicator = ctx.dp_comm
        self.every, self.rounds, self.last = ctx.train.sync_every, 0, 0

    def select(self, step: int, indices: list[int]) -> list[int] | None:
        return indices

    def after_step(self, done: int, last: bool) -> None:
        if done % self.every == 0 or last:
            with torch.no_grad():
                for p in self.params:
                    self.comm.all_reduce(p.data)
                    p.data.div_(self.comm.size)
            self.rounds, self.last = self.rounds + 1, done

    def at_boundary(self, done: int) -> bool:
        return done == self.last

    def restart(self) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {"test_rounds": self.rounds}


class CountingGrads:
    """The gradient side an optimizer asks for: the data-parallel strategy's, counting
    the steps it follows the optimizer through (its figure reaches the metrics)."""

    def __init__(self, inner: GradSync, dp: Communicator) -> None:
        self.inner, self.optimizer = inner, None
        self.steps = 0

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __getattr__(self, name: str) -> Any:  # every other GradSync call: the inner one
        return getattr(self.inner, name)

    def after_optimizer_step(self) -> None:
        assert self.optimizer is not None, "the composition hands over the optimizer"
        self.steps += 1
        self.inner.after_optimizer_step()

    def comm_stats(self) -> dict[str, float]:
        return {**self.inner.comm_stats(), "test_optimizer_steps": float(self.steps)}


def _build_sgd(ctx: OptimizerContext) -> torch.optim.Optimizer:
    return torch.optim.SGD(ctx.groups, lr=ctx.lr, momentum=0.9)


register_sync_mode(SyncMode("test-average", AverageEvery))
register_optimizer(OptimizerKind("test-sgd", _build_sgd, wrap_grads=CountingGrads))


def _fit(steps: int, run_dir: str, checkpoint: dict | None = None, **keys: Any) -> dict:
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = tiny_config(checkpoint, steps=steps, log_every=2, **keys)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    summary = Trainer(model, SyntheticTokens(mask=True), token_loss, cfg, run_dir=run_dir,
                      collate_fn=collate_token_batch, progress=False).fit()
    return {"state": state_of(model), "summary": summary}


def _both_modes(run_dir: str, **keys: Any) -> list[dict]:
    """The mode written here and the built-in local SGD, in one set of processes."""
    return [_fit(6, f"{run_dir}/{sync}", sync=sync, sync_every=2, **keys)
            for sync in ("test-average", "local_sgd")]


def test_a_sync_mode_defined_in_a_test_trains_as_local_sgd(tmp_path):
    got = run_distributed(_both_modes, 2, args=(str(tmp_path),), timeout=180)
    mine, builtin = got[0]
    # the same algorithm over the same shares: equal to fp32 summation-order noise
    assert_states_close(mine["state"], builtin["state"])
    assert_states_close(got[1][0]["state"], mine["state"], atol=0)  # replicas agree
    assert mine["summary"]["test_rounds"] == 3
    assert '"test_rounds"' in (tmp_path / "test-average" / "metrics.jsonl").read_text()


def test_the_sync_mode_resumes_on_its_trajectory(tmp_path):
    # plain SGD: replicas stepping apart keep no per-rank optimizer state that a
    # checkpoint (one copy of the replicated state) would leave out
    mode = {"sync": "test-average", "sync_every": 2, "optimizer": "sgd", "momentum": 0.0,
            "lr": 0.3}
    run_dir = str(tmp_path / "run")
    whole = run_distributed(_fit, 2, args=(6, str(tmp_path / "whole")), kwargs=mode,
                            timeout=120)
    keys = {"checkpoint": {"every": 2}, **mode}
    run_distributed(_fit, 2, args=(4, run_dir), kwargs=keys, timeout=120)
    resumed = run_distributed(_fit, 2, args=(6, run_dir), kwargs=keys, timeout=120)
    assert resumed[0]["summary"]["start_step"] == 4
    assert_states_close(resumed[0]["state"], whole[0]["state"], atol=0)


def test_an_optimizer_with_its_gradient_side_trains_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    keys = {"checkpoint": {"every": 3}, "optimizer": "test-sgd", "grad_accum": 2}
    run_distributed(_fit, 2, args=(3, str(run_dir)), kwargs=keys, timeout=120)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["test_optimizer_steps"] == 3  # its gradient side followed every step
    resumed = run_distributed(_fit, 2, args=(6, str(run_dir)), kwargs=keys, timeout=120)
    assert resumed[0]["summary"]["start_step"] == 3
    # the plain single-process loop with the same optimizer (momentum restored)
    reference = reference_train(6, mask=True, optimizer="test-sgd", grad_accum=2)
    assert_states_close(resumed[0]["state"], reference)
    assert_states_close(resumed[1]["state"], resumed[0]["state"], atol=0)


def test_unknown_sync_mode_and_optimizer_are_refused_naming_the_registry():
    from disttrain.errors import ConfigError
    from disttrain.run_checks import resolve

    for key, value, how in (("sync", "gossip", "register_sync_mode"),
                            ("optimizer", "adafactor", "register_optimizer")):
        with pytest.raises(ConfigError) as info:
            resolve(tiny_config(**{key: value}), 2)
        assert info.value.field == f"train.{key}" and how in str(info.value)
        assert "test-" in str(info.value)  # the registered ones are offered
