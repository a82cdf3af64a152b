"""Which device and backend a run picks: cuda + NCCL on a GPU, the CPU + Gloo otherwise."""

from __future__ import annotations

import torch

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
