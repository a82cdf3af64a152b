"""The Kubernetes example: a PyTorchJob whose pods each run `disttrain train` as their
node's elastic agent. Rendered with the variables the training operator sets on a pod,
its command is a valid `disttrain train` with the job's node and process layout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import disttrain.launch.agent
from disttrain.cli import main

MANIFEST = Path(__file__).resolve().parents[1] / "examples" / "kubernetes" / "pytorchjob.yaml"
# what the training operator sets on the Worker pod of a 2-node job (it also sets the
# pod-level RANK / WORLD_SIZE, which count pods)
OPERATOR_ENV = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8",
                "PET_MASTER_ADDR": "disttrain-gpt-master-0", "PET_MASTER_PORT": "23456",
                "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "disttrain-gpt-master-0",
                "MASTER_PORT": "23456"}


def _pods() -> dict:
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load(MANIFEST.read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    return job


def _rendered_argv(container: dict, env: dict) -> list[str]:
    """The container's command as the shell would run it, `disttrain` first."""
    script = container["args"][0].replace("exec disttrain", "printf '%s\\n' disttrain", 1)
    done = subprocess.run([*container["command"], script], env=env, capture_output=True,
                          text=True, timeout=30, check=True)
    return done.stdout.splitlines()


def test_the_manifest_renders_to_the_jobs_layout(monkeypatch, tmp_path):
    job = _pods()
    spec = job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(r["replicas"] for r in spec.values())
    assert nodes == 2 and job["spec"]["nprocPerNode"] == "8"
    container = spec["Worker"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "JOB_NAME"} <= set(env)
    argv = _rendered_argv(container, {**OPERATOR_ENV, **env, "PATH": "/usr/bin:/bin"})
    assert argv[:2] == ["disttrain", "train"]
    assert "/shared/runs/disttrain-gpt" in argv

    # the rendered command, run by disttrain: this pod is its node's agent, not a worker
    calls = []
    monkeypatch.setattr(disttrain.launch.agent, "launch", lambda opts, target: calls.append(
        (opts, target)) or 0)
    for key, value in OPERATOR_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "runs"
    args = [a if a != "/shared/runs/disttrain-gpt" else str(run_dir) for a in argv[2:]]
    import disttrain.plan.capacity as capacity  # 8 local ranks on this small host
    monkeypatch.setattr(capacity, "host_available_bytes", lambda: 8 * 64 * 2**30)
    assert main(["train", *args]) == 0
    (opts, target), = calls
    assert (opts.nnodes, opts.nproc) == ("2", 8)
    assert opts.rdzv_endpoint == "disttrain-gpt-master-0:23456"
    assert opts.rdzv_id == "disttrain-gpt" and opts.max_restarts == 3
    assert "train.steps=10000" in target
