"""A strategy written here, outside src/, plugs in at one place and trains through the
public Trainer: proof that the composition uses strategies only through their declared
interfaces (GradSync, ShardedState) and the registry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from support import SyntheticTokens, state_of, tiny_config
from test_data_parallel import assert_states_close, reference_train
from torch import nn

from disttrain.parallel import (
    GradSync,
    ShardedState,
    StatePiece,
    StrategyContext,
    register_strategy,
    strategy_names,
)
from disttrain.testing import run_distributed


class ParameterAllReduce:
    """The plainest data parallelism: after the last backward, one blocking all-reduce
    per parameter (no buckets, no overlap); every rank holds the summed gradient."""

    def __init__(self, ctx: StrategyContext) -> None:
        self.comm = ctx.dp_comm
        self.params = [p for p in ctx.module.parameters() if p.requires_grad]
        self.grad_replicas = self.comm.size
        self.reductions = 0
        with torch.no_grad():
            for p in self.params:
                self.comm.broadcast(p.data, src=0)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # nothing is reduced before finish_gradient_sync anyway

    def backward(self, scope: int, last: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def reduce_loss_totals(self, totals: torch.Tensor):
        return self.comm.all_reduce(totals, async_op=True)

    def finish_gradient_sync(self, scale: float) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad)
            p.grad.mul_(scale)
            self.reductions += 1

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, p.grad) for p in self.params]

    def clip_grad_norm(self, max_norm: float) -> float:
        limit = max_norm if max_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.params, limit))

    def after_optimizer_step(self) -> None:
        pass

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        size = sum(p.numel() * p.element_size() for p in self.params)
        return {"params": size, "grads": size, "optimizer": 0}

    def comm_stats(self) -> dict[str, float]:
        return {"test_reductions": float(self.reductions)}

    def finalize(self) -> None:
        pass


class RankZeroState:
    """Dp rank 0 saves every parameter and its optimizer state whole."""

    def __init__(self, ctx: StrategyContext) -> None:
        self.module, self.placement, self.rank = ctx.module, ctx.placement, ctx.dp_comm.rank

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        params = [p for p in self.module.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def state_pieces(self, optimizer: torch.optim.Optimizer) -> list[StatePiece]:
        if self.rank != 0:
            return []
        out = []
        for p in {id(p): p for p in self.module.parameters()}.values():
            name = self.placement.name(p)
            out.append(StatePiece(f"model/{name}", p.detach(), tuple(p.shape),
                                  (0,) * p.dim()))
            for key, v in optimizer.state.get(p, {}).items():
                shape = tuple(v.shape)
                out.append(StatePiece(f"optim/{name}/{key}", v.detach(), shape,
                                      (0,) * len(shape)))
        return out

    def frozen_pieces(self) -> list[StatePiece]:
        return []  # state_pieces saves every parameter

    def load_state(self, source, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p in {id(p): p for p in self.module.parameters()}.values():
                name = self.placement.name(p)
                p.copy_(source.tensor(f"model/{name}"))
                keys = source.names(f"optim/{name}/")
                if keys:
                    optimizer.state[p] = {k.rsplit("/", 1)[1]: source.tensor(k)
                                          for k in keys}


register_strategy("test-allreduce",
                  lambda ctx: (ParameterAllReduce(ctx), RankZeroState(ctx)))


def _fit(steps: int, run_dir: str, checkpoint: dict | None = None) -> dict:
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = tiny_config(checkpoint, strategy="test-allreduce", steps=steps, grad_accum=2,
                      log_every=2)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    summary = Trainer(model, SyntheticTokens(mask=True), token_loss, cfg, run_dir=run_dir,
                      collate_fn=collate_token_batch, progress=False).fit()
    return {"state": state_of(model), "summary": summary}


def test_a_strategy_defined_in_a_test_trains_through_the_trainer(tmp_path):
    got = run_distributed(_fit, 2, args=(6, str(tmp_path / "run")), timeout=120)
    assert_states_close(got[0]["state"], reference_train(6, mask=True, grad_accum=2))
    assert_states_close(got[1]["state"], got[0]["state"], atol=0)
    records = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"test_reductions"' in records  # its comm figures reach the metrics


def test_its_checkpoint_resumes_on_the_same_trajectory(tmp_path):
    run_dir = str(tmp_path / "run")
    run_distributed(_fit, 2, args=(3, run_dir), kwargs={"checkpoint": {"every": 3}},
                    timeout=120)
    resumed = run_distributed(_fit, 2, args=(6, run_dir),
                              kwargs={"checkpoint": {"every": 3}}, timeout=120)
    assert resumed[0]["summary"]["start_step"] == 3
    assert_states_close(resumed[0]["state"], reference_train(6, mask=True, grad_accum=2))


def test_built_in_strategies_declare_the_interfaces():
    from disttrain.models import GPT
    from disttrain.parallel.ddp import DataParallel
    from disttrain.parallel.placement import whole_model_placement
    from disttrain.parallel.replicated import ReplicatedState
    from disttrain.parallel.sync import LocalGradients
    from disttrain.parallel.zero import ZeroDataParallel, model_units

    assert {"ddp", "zero", "local", "test-allreduce"} <= set(strategy_names())
    comm = _OneRank()
    models = [GPT(tiny_config().model) for _ in range(3)]
    zero = ZeroDataParallel(model_units(models[2]), comm, 2,
                            whole_model_placement(models[2]))
    for grads in (DataParallel(models[0], comm, 2**20),
                  LocalGradients(models[1], comm, False), zero):
        assert isinstance(grads, GradSync), type(grads)
    for state in (ReplicatedState(models[0], whole_model_placement(models[0])), zero):
        assert isinstance(state, ShardedState), type(state)
    assert not isinstance(object(), GradSync)


class _OneRank:
    """A communicator of one rank that never talks (enough to build the handles)."""

    rank, size = 0, 1

    def broadcast(self, tensor, src):
        pass


def test_an_unknown_strategy_is_refused_before_launch():
    from disttrain.errors import ConfigError
    from disttrain.run_checks import resolve

    with pytest.raises(ConfigError) as info:
        resolve(tiny_config(strategy="nope"), 2)
    assert info.value.field == "parallel.strategy" and "register_strategy" in str(info.value)
