"""Data parallelism against a plain single-process loop and against torch DDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import SyntheticTokens, fit_tiny, state_of, tiny_config
from torch.nn.parallel import DistributedDataParallel

from disttrain.data import GlobalOrderSampler, collate_token_batch
from disttrain.models import GPT, token_loss
from disttrain.run_checks import resolve
from disttrain.testing import run_distributed
from disttrain.train.optim import build_optimizer, lr_at, set_lr

ATOL = 1e-5


def reference_train(steps: int, mask: bool = False, **train) -> dict[str, torch.Tensor]:
    """The oracle: one process, the whole global batch in one forward, loss = mean over
    every target token of the batch, plain backward, clip, optimizer step."""
    cfg = tiny_config(**train, steps=steps)
    batch = resolve(cfg, 1).batch
    data = SyntheticTokens(mask=mask)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.train, cfg.train.lr)
    sampler = GlobalOrderSampler(len(data), cfg.train.seed)
    for step in range(steps):
        set_lr(opt, lr_at(step, cfg.train, cfg.train.lr))
        b = collate_token_batch([data[i] for i in sampler.indices(step * batch.global_batch,
                                                                  batch.global_batch)])
        loss_sum, count = token_loss(model(b["input_ids"]), b["targets"])
        opt.zero_grad()
        (loss_sum / count).backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
    return state_of(model)


def _disttrain_and_ddp(steps: int, run_dir: str):
    """Both in the same ranks on the same inputs: ours through Trainer, torch's DDP
    by hand on this rank's slice of each global batch."""
    ours = fit_tiny(steps, run_dir)
    cfg = tiny_config(steps=steps)
    plan = resolve(cfg, dist.get_world_size())
    data = SyntheticTokens()
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    ddp = DistributedDataParallel(model)
    opt = build_optimizer(model, cfg.train, cfg.train.lr)
    sampler = GlobalOrderSampler(len(data), cfg.train.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        set_lr(opt, lr_at(step, cfg.train, cfg.train.lr))
        idx = sampler.rank_slice(step * plan.batch.global_batch, plan.batch.global_batch,
                                 rank, world)
        b = collate_token_batch([data[i] for i in idx])
        loss_sum, count = token_loss(ddp(b["input_ids"]), b["targets"])
        opt.zero_grad()
        (loss_sum / count).backward()  # DDP averages over ranks: equal counts here
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
    return ours, state_of(model)


def assert_states_close(actual: dict, expected: dict, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _after_1_and_20_steps(run_dir: str) -> list:
    """Both step counts in one set of processes (saves a spawn)."""
    return [_disttrain_and_ddp(steps, f"{run_dir}/{steps}") for steps in (1, 20)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_dp_matches_single_process_and_ddp(world_size, tmp_path):
    per_rank = run_distributed(_after_1_and_20_steps, world_size, args=(str(tmp_path),),
                               timeout=180)
    for i, steps in enumerate((1, 20)):
        results = [rank_results[i] for rank_results in per_rank]
        expected = reference_train(steps)
        for ours, ddp in results:
            assert_states_close(ours, expected)
            assert_states_close(ddp, expected)
        # the replicas stay identical
        for ours, _ in results[1:]:
            assert_states_close(ours, results[0][0], atol=0)


def test_training_moves_parameters(tmp_path):
    """Guards the equivalence tests against a trainer that does nothing."""
    trained = run_distributed(fit_tiny, 2, args=(5, str(tmp_path)), timeout=120)[0]
    cfg = tiny_config()
    torch.manual_seed(cfg.train.seed)
    initial = state_of(GPT(cfg.model))
    moved = max((trained[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3


@pytest.mark.parametrize("world_size,grad_accum", [(1, 4), (2, 2), (4, 1)])
def test_split_invariance_with_masked_targets(world_size, grad_accum, tmp_path):
    """Same global batch, different ranks x accumulation, samples with different numbers
    of target tokens: the trajectory is the one of the single-process oracle."""
    state = run_distributed(fit_tiny, world_size,
                            args=(20, str(tmp_path), True),
                            kwargs={"grad_accum": grad_accum}, timeout=180)[0]
    assert_states_close(state, reference_train(20, mask=True))
