"""Checksums, fallback to the newest intact checkpoint, the index, and export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_model
from support import fit_tiny, tiny_config

from disttrain.checkpoint import find_checkpoint, open_checkpoint
from disttrain.checkpoint.export import export_weights
from disttrain.errors import UserError
from disttrain.models import GPT
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    state = run_distributed(fit_tiny, 2, args=(10, str(run_dir)),
                            kwargs={"checkpoint": {"every": 5, "keep": 3}}, timeout=120)[0]
    return run_dir, state


@pytest.fixture
def run_copy(trained_run, tmp_path):
    shutil.copytree(trained_run[0], tmp_path / "run")
    return tmp_path / "run"


def _shard(run_dir: Path, step: int) -> Path:
    return sorted((run_dir / "checkpoints" / f"step-{step:08d}").glob("shard-*"))[0]


def test_index_describes_every_tensor(trained_run):
    run_dir, state = trained_run
    ckpt = open_checkpoint(find_checkpoint(run_dir, warn=pytest.fail))
    index = ckpt.index
    assert index.step == 10 and index.meta["position"] == 80
    assert index.meta["world_size"] == 2 and index.meta["layout"]["dp"] == 2
    assert set(index.files) == {"shard-r00000.safetensors", "shard-r00001.safetensors"}
    for name, tensor in state.items():
        entry = index.tensors[f"model/{name}"] if f"model/{name}" in index.tensors else None
        if entry is None:  # the tied head is stored once, under the embedding's name
            assert name == "head.weight"
            continue
        assert list(entry.shape) == list(tensor.shape) and entry.dtype == "float32"
        torch.testing.assert_close(ckpt.reader.tensor(f"model/{name}"), tensor, rtol=0, atol=0)
    assert any(n.startswith("optim/") and n.endswith("/exp_avg_sq") for n in index.tensors)
    assert {"rng/rank0/cpu", "rng/rank1/cpu"} <= set(index.tensors)
    raw = json.loads((ckpt.directory / "index.json").read_text())
    assert all(len(f["sha256"]) == 64 for f in raw["files"].values())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_shard_is_named_and_skipped(run_copy, damage):
    bad = _shard(run_copy, 10)
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 3]
    bad.write_bytes(bytes(data))
    warnings: list[str] = []
    found = find_checkpoint(run_copy, warn=warnings.append)
    assert found.name == "step-00000005"
    assert len(warnings) == 1 and bad.name in warnings[0] and "step-00000010" in warnings[0]


def test_no_intact_checkpoint_is_a_one_line_error(run_copy):
    for step in (5, 10):
        shard = _shard(run_copy, step)
        shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    with pytest.raises(UserError, match="no intact checkpoint"):
        find_checkpoint(run_copy, warn=lambda _: None)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    # the run's vocabulary is below the byte corpus's: raise it, so that the checkpoints
    # are what the command line refuses
    proc = subprocess.run([DISTTRAIN, "train", "--run-dir", str(run_copy), "--set",
                           "model.vocab_size=256"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no intact checkpoint" in proc.stderr


def test_fallback_resume_redoes_the_lost_steps(run_copy, trained_run):
    bad = _shard(run_copy, 10)
    bad.write_bytes(bad.read_bytes()[:-7])
    state = run_distributed(fit_tiny, 2, args=(10, str(run_copy)),
                            kwargs={"checkpoint": {"every": 5, "keep": 3}}, timeout=120)[0]
    for name, tensor in trained_run[1].items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6)


def test_export_loads_into_the_plain_model(trained_run, tmp_path):
    run_dir, state = trained_run
    out, weights = export_weights(run_dir, tmp_path / "model.safetensors", warn=pytest.fail)
    assert weights.step == 10 and weights.source.startswith("checkpoint")
    model = GPT(tiny_config().model)
    load_model(model, str(out))  # plain safetensors, strict: every key present
    for name, tensor in state.items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)


def test_export_cli_errors(tmp_path):
    proc = subprocess.run([DISTTRAIN, "export", str(tmp_path), "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "holds no checkpoint" in proc.stderr
