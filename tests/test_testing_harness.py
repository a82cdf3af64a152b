"""The multi-process harness itself: results, failures and hangs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from disttrain.testing import DistributedTestError, distributed, run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check


def _sum_of_ranks(scale: float) -> float:
    t = torch.tensor([float(dist.get_rank()) * scale])
    dist.all_reduce(t)
    return t.item()


def _rank_two_fails() -> None:
    if dist.get_rank() == 2:
        raise ValueError("boom on rank two")
    dist.barrier()


def _rank_one_skips_collective() -> None:
    if dist.get_rank() == 1:
        time.sleep(120)  # alive but never joins: rank 0 waits in the all-reduce
    else:
        dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("world_size", [1, 8])
def test_results_come_back_in_rank_order(world_size):
    out = run_distributed(_sum_of_ranks, world_size, args=(2.0,), timeout=90)
    assert out == [2.0 * sum(range(world_size))] * world_size


def test_a_failing_rank_fails_the_run_with_its_traceback():
    with pytest.raises(DistributedTestError, match="(?s)rank 2 failed.*boom on rank two"):
        run_distributed(_rank_two_fails, 3, timeout=60)


def test_a_skipped_collective_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_rank_one_skips_collective, 2, timeout=8)
    assert time.monotonic() - start < 40
    assert "timed out after 8s: ranks [0, 1] of 2" in str(err.value)


@distributed(world_size=2, timeout=60)
def test_decorator_runs_body_on_every_rank():
    assert dist.get_world_size() == 2
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


def test_an_unknown_backend_is_refused_before_anything_is_spawned():
    with pytest.raises(ValueError, match="backend='mpi'"):
        run_distributed(_sum_of_ranks, 1, args=(1.0,), backend="mpi")


def test_a_process_that_initialised_cuda_spawns_its_gloo_ranks(monkeypatch):
    """Seen on an H100 (2026-11-26): a Gloo world forked from a pytest process that had
    run autograd on CUDA failed in every rank ("Unable to handle autograd's threading in
    combination with fork-based multiprocessing"). Such a process spawns."""
    from disttrain import testing

    monkeypatch.setenv(testing.START_METHOD_ENV, "fork")
    assert testing.default_start_method("gloo") == "fork"
    assert testing.default_start_method("nccl") == "spawn"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert testing.default_start_method("gloo") == "spawn"
