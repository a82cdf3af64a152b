"""Which device and backend a run picks: cuda + NCCL on a GPU, the CPU + Gloo otherwise;
cuda + Gloo in the shared-GPU test mode, which is refused where it would mislead."""

from __future__ import annotations

import pytest
import torch
from support import tiny_config

from disttrain.errors import ConfigError
from disttrain.names import SHARED_GPU_ENV
from disttrain.run_checks import resolve
from disttrain.train import runtime


def _fake_gpu(monkeypatch) -> list[int]:
    """torch.cuda reports one GPU; set_device calls are recorded instead of made."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_auto_picks_the_local_gpu_when_there_is_one(monkeypatch):
    chosen = _fake_gpu(monkeypatch)
    assert runtime.pick_device("auto", 1) == torch.device("cuda", 1)
    assert runtime.pick_device("auto", 0, "nccl") == torch.device("cuda", 0)
    assert runtime.pick_device("auto", 0, "cpu:gloo,cuda:nccl") == torch.device("cuda", 0)
    assert chosen == [1, 0, 0]


def test_auto_stays_on_the_cpu_under_an_existing_gloo_group(monkeypatch):
    """The CPU test harness creates Gloo groups; on a GPU machine its runs stay on the CPU
    rather than hand CUDA tensors to Gloo."""
    chosen = _fake_gpu(monkeypatch)
    assert runtime.pick_device("auto", 0, "gloo") == torch.device("cpu")
    assert runtime.pick_device("cpu", 0) == torch.device("cpu")
    assert chosen == []


def test_no_gpu_means_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.pick_device("auto", 0) == torch.device("cpu")
    assert runtime.pick_device("auto", 0, "nccl") == torch.device("cpu")


def test_shared_gpu_mode_puts_the_ranks_on_the_visible_gpus(monkeypatch):
    """DISTTRAIN_SHARED_GPU=1: cuda:(local rank mod GPUs), under any group (the harness's
    Gloo one too), since the collectives go through Gloo."""
    chosen = _fake_gpu(monkeypatch)
    monkeypatch.setenv(SHARED_GPU_ENV, "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runtime.pick_device("auto", 3, "gloo") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert runtime.pick_device("auto", 3) == torch.device("cuda", 1)
    assert chosen == [0, 1]


@pytest.mark.parametrize("keys,gpus,local,field", [
    ({}, 0, 2, SHARED_GPU_ENV),                       # no GPU to share
    ({"device": "cpu"}, 1, 2, "train.device"),
    ({"backend": "nccl"}, 1, 2, "parallel.backend"),  # NCCL refuses two ranks on one GPU
    ({}, 2, 2, SHARED_GPU_ENV),                       # a GPU per rank: train with NCCL
    ({}, 1, 1, SHARED_GPU_ENV),                       # a world of one
])
def test_shared_gpu_mode_is_refused_where_it_would_mislead(monkeypatch, keys, gpus, local,
                                                           field):
    monkeypatch.setenv(SHARED_GPU_ENV, "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError) as exc:
        resolve(tiny_config(**keys), local)
    assert exc.value.field == field
    assert "\n" not in str(exc.value) and "(" in str(exc.value)  # one line, with the fix


def test_shared_gpu_mode_is_accepted_with_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setenv(SHARED_GPU_ENV, "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve(tiny_config(dp=2), 2).layout.degree("dp") == 2
