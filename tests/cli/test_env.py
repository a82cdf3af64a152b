"""``disttrain env``: the facts a bug report needs, as text or JSON, with or without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

import disttrain
from disttrain.cli import main
from disttrain.commands import env


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)


def test_json_has_every_key_without_cuda(no_cuda, capsys):
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"disttrain", "python", "platform", "torch", "backends",
                           "devices", "network", "packages"}
    assert report["disttrain"] == disttrain.__version__
    assert report["torch"] == {"version": torch.__version__, "cuda": None, "cudnn": None,
                               "nccl": None}
    assert set(report["backends"]) == {"gloo", "nccl", "mpi"} and report["backends"]["gloo"]
    assert report["devices"]["cuda"] == [] and report["devices"]["cpu_count"] >= 1
    assert report["network"]["env"] == {"GLOO_SOCKET_IFNAME": "lo"}
    assert set(report["packages"]) == set(env.EXTRAS)
    assert report["packages"]["safetensors"] != env.NOT_INSTALLED


def test_text_is_one_fact_per_line(no_cuda, monkeypatch, capsys):
    real = env.package_version
    monkeypatch.setattr(env, "package_version",
                        lambda name: env.NOT_INSTALLED if name == "tomli" else real(name))
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"disttrain: {disttrain.__version__}"
    assert f"torch: {torch.__version__}" in lines
    assert "torch CUDA: not built with CUDA" in lines and "CUDA devices: none" in lines
    assert "GLOO_SOCKET_IFNAME=lo" in lines and "tomli: not installed" in lines
    assert any(line.startswith("network interfaces: ") for line in lines)
    assert any(line.startswith("backends: gloo yes") for line in lines)


def test_gpus_are_listed_with_their_memory(monkeypatch):
    class Props:
        name, total_memory = "Fake GPU", 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    report = env.collect()
    assert report["devices"]["cuda"] == [{"name": "Fake GPU", "memory_bytes": 80 * 2**30}] * 2
    assert report["torch"]["cuda"] == "12.4"  # cuDNN / NCCL: whatever this build has
    assert "cuda:1: Fake GPU, 80.0 GiB" in env.format_text(report)
