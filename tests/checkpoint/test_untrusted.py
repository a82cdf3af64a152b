"""Checkpoints are untrusted input: each crafted checkpoint is refused with one line
naming the file and the reason, nothing outside its directory is opened, and loading
falls back to the previous intact checkpoint (or stops with a UserError, exit 2).

Most checkpoints here are written in-process by the library's own save path (one rank,
no process group) and then tampered with; the last two tests take the trainer's resume
path and the `disttrain train` command over a real two-rank run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as safetensors_bytes
from support import fit_tiny

import disttrain.checkpoint.format as ckpt_format
from disttrain.checkpoint import (
    CheckpointManager,
    CheckpointRejected,
    find_checkpoint,
    open_checkpoint,
)
from disttrain.checkpoint.export import export_weights
from disttrain.cli import main as cli_main
from disttrain.errors import UserError
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))
SHARD = "shard-r00000.safetensors"
_opened: list[str] | None = None  # paths opened while a test records them


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, Path)):
        _opened.append(os.path.realpath(args[0]))


sys.addaudithook(_audit)  # sees every open() and os.open(), however it is reached


def _state(step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Whole tensors, a tensor saved as two boxes and one saved as two flat ranges."""
    tensors = {"model/w": torch.arange(12.0).reshape(4, 3) + step,
               "model/count": torch.tensor([step, 2 * step], dtype=torch.int64),
               "rng/rank0/cpu": torch.get_rng_state(),
               "model/box#a": torch.full((2, 2), float(step)), "model/box#b": torch.ones(2, 2),
               "model/flat#a": torch.zeros(3), "model/flat#b": torch.full((3,), 7.0)}
    parts = {"model/box#a": ("model/box", (4, 2), {"offsets": [0, 0], "shape": [2, 2]}),
             "model/box#b": ("model/box", (4, 2), {"offsets": [2, 0], "shape": [2, 2]}),
             "model/flat#a": ("model/flat", (2, 3), (0, 3)),
             "model/flat#b": ("model/flat", (2, 3), (3, 6))}
    return tensors, parts


def _save(run_dir: Path, steps: tuple[int, ...]) -> None:
    manager = CheckpointManager(run_dir, 0, 1, keep=5, async_save=False)
    for step in steps:
        tensors, parts = _state(step)
        manager.save(step, tensors, dict.fromkeys(tensors, 0),
                     {"position": 8 * step, "world_size": 1}, parts)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    _save(run_dir, (5, 10))
    return run_dir


@pytest.fixture
def run(saved, tmp_path) -> Path:
    """A copy of the saved run, and beside it (outside every checkpoint) a sentinel:
    a valid shard with the same tensors, whose values would show if it were loaded."""
    shutil.copytree(saved, tmp_path / "run")
    sentinel = tmp_path / "sentinel.safetensors"
    tensors, _ = _state(777)
    sentinel.write_bytes(safetensors_bytes(tensors))
    return tmp_path / "run"


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def _edit_index(directory: Path, edit: Callable[[dict], object]) -> None:
    path = directory / "index.json"
    data = json.loads(path.read_text())
    replaced = edit(data)
    path.write_text(json.dumps(data if replaced is None else replaced))


def _list_file(data: dict, name: str, content: bytes) -> None:
    data["files"][name] = {"bytes": len(content),
                           "sha256": hashlib.sha256(content).hexdigest()}


def _rewrite_shard(directory: Path, content: bytes) -> None:
    """Replace the shard and record its true size and checksum (so only the other
    checks can catch it)."""
    (directory / SHARD).write_bytes(content)
    _edit_index(directory, lambda d: _list_file(d, SHARD, content))


def _point_shards_at(directory: Path, name: str, listed: bool = True) -> None:
    sentinel = directory.parents[2] / "sentinel.safetensors"

    def edit(data: dict) -> None:
        for entry in data["tensors"].values():
            for shard in entry["shards"]:
                shard["file"] = name
        if listed:
            data["files"] = {}
            _list_file(data, name, sentinel.read_bytes())
    _edit_index(directory, edit)


def _set(name: str, field: str, value: object) -> Callable[[dict], None]:
    return lambda data: data["tensors"][name].__setitem__(field, value)


def _lying_offsets(directory: Path) -> None:
    raw = (directory / SHARD).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    begin, end = header["model/w"]["data_offsets"]
    header["model/w"]["data_offsets"] = [begin, end + 4096]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    _rewrite_shard(directory, struct.pack("<Q", len(text)) + text + raw[8 + length:])


def _symlink_out(directory: Path) -> None:
    (directory / SHARD).unlink()
    (directory / SHARD).symlink_to(directory.parents[2] / "sentinel.safetensors")


def _unlisted(directory: Path) -> None:
    shutil.copy(directory.parents[2] / "sentinel.safetensors", directory / "extra.safetensors")
    _point_shards_at(directory, "extra.safetensors", listed=False)


def _same_piece_twice(data: dict) -> None:
    """Both boxes of model/box read the first piece: the count of stored elements adds
    up, but the second half of the tensor would be left uninitialised."""
    first, second = data["tensors"]["model/box"]["shards"]
    second["key"] = first["key"]


class _Planted:
    def __reduce__(self):
        return (os.abort, ())  # would kill the test run if it were ever unpickled


# case -> (tamper with the checkpoint directory, the file named, the reason shown)
CASES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "traversal-relative": (lambda d: _point_shards_at(d, "../../../sentinel.safetensors"),
                           "sentinel.safetensors", "not a plain file name"),
    "traversal-absolute": (lambda d: _point_shards_at(d, str(d.parents[2] /
                                                             "sentinel.safetensors")),
                           "sentinel.safetensors", "not a plain file name"),
    "symlink-outside": (_symlink_out, SHARD, "resolves outside"),
    "unlisted-shard": (_unlisted, "extra.safetensors", "not in the index's file list"),
    "dtype-mismatch": (lambda d: _edit_index(d, _set("model/w", "dtype", "int8")),
                       SHARD, "is float32, the index says int8"),
    "shape-1e12": (lambda d: _edit_index(d, _set("model/w", "shape", [10**12, 3])),
                   SHARD, "only partly stored"),
    "negative-shape": (lambda d: _edit_index(d, _set("model/w", "shape", [-5, 3])),
                       "index.json", "shape is -5, not a non-negative integer"),
    "unknown-dtype": (lambda d: _edit_index(d, _set("model/w", "dtype", "float128")),
                      "index.json", "unknown dtype 'float128'"),
    "lying-header-offsets": (_lying_offsets, SHARD, "data_offsets"),
    "index-json-list": (lambda d: _edit_index(d, lambda data: [data]),
                        "index.json", "JSON list"),
    "index-not-json": (lambda d: (d / "index.json").write_bytes(b"{\"format\": \xff"),
                       "index.json", "not JSON"),
    "garbage-shard": (lambda d: _rewrite_shard(d, os.urandom(4096)), SHARD,
                      "not a safetensors file"),
    "truncated-shard": (lambda d: _rewrite_shard(d, (d / SHARD).read_bytes()[:-20]), SHARD,
                        "tensor data ends at"),
    "duplicate-piece": (lambda d: _edit_index(d, _same_piece_twice), SHARD,
                        "listed as two shards"),
    "planted-pickle": (lambda d: _rewrite_shard(d, pickle.dumps(_Planted())), SHARD,
                       "not a safetensors file"),
}


@pytest.fixture
def watched(monkeypatch):
    """Record every path opened, by Python or by safetensors; unpickling fails the test."""
    global _opened
    _opened = []
    real_safe_open = ckpt_format.safe_open

    def safe_open(path, *args, **kwargs):
        _opened.append(os.path.realpath(path))
        return real_safe_open(path, *args, **kwargs)
    monkeypatch.setattr(ckpt_format, "safe_open", safe_open)

    def no_unpickling(*_, **__):
        raise AssertionError("a checkpoint file was unpickled")
    for target, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                         (torch, "load")):
        monkeypatch.setattr(target, name, no_unpickling)
    yield _opened
    _opened = None


def _assert_inside(opened: list[str], run_dir: Path) -> None:
    outside = [p for p in opened if not p.startswith(os.path.realpath(run_dir) + os.sep)
               and "sentinel" in p]
    assert outside == [], f"opened outside the checkpoint: {outside}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_checkpoint_falls_back_to_the_previous_one(run, watched, case):
    tamper, named, reason = CASES[case]
    tamper(_step(run, 10))
    watched.clear()  # the tampering itself read the sentinel
    warnings: list[str] = []
    found = find_checkpoint(run, warn=warnings.append)
    assert found.name == "step-00000005"
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "step-00000010" in warnings[0] and named in warnings[0], warnings[0]
    assert reason in warnings[0], warnings[0]
    ckpt = open_checkpoint(found)
    torch.testing.assert_close(ckpt.reader.tensor("model/w"), torch.arange(12.0).reshape(4, 3)
                               + 5, rtol=0, atol=0)
    assert ckpt.reader.tensor("model/box")[:2].eq(5).all()
    assert ckpt.reader.tensor("model/flat").reshape(-1)[3:].eq(7).all()
    _assert_inside(watched, run)


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_checkpoint_alone_is_a_user_error(run, watched, case, tmp_path, capsys):
    tamper, named, reason = CASES[case]
    shutil.rmtree(_step(run, 5))
    tamper(_step(run, 10))
    watched.clear()
    with pytest.raises(UserError, match="no intact checkpoint") as error:
        find_checkpoint(run, warn=pytest.fail)
    assert named in str(error.value) and reason in str(error.value)
    with pytest.raises(UserError):
        export_weights(run, tmp_path / "out.safetensors", warn=pytest.fail)
    assert cli_main(["export", str(run), "--out", str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and reason in err, err
    assert not (tmp_path / "out.safetensors").exists()
    _assert_inside(watched, run)


def test_open_checkpoint_checks_the_headers_too(run, watched):
    """A rank that opens the checkpoint rank 0 chose still refuses one that disagrees
    with its files (they may have changed since)."""
    CASES["dtype-mismatch"][0](_step(run, 10))
    with pytest.raises(CheckpointRejected, match="the index says int8") as error:
        open_checkpoint(_step(run, 10))
    assert error.value.path == _step(run, 10) / SHARD


def test_reader_refuses_a_piece_the_index_misdescribes(run, watched):
    """The reader's own guard, for an index changed after the checks: a piece is never
    cast to the index's dtype, and a file outside the index is never opened."""
    ckpt = open_checkpoint(_step(run, 10))
    ckpt.index.tensors["model/w"].dtype = "int8"
    with pytest.raises(CheckpointRejected, match="the index says torch.int8"):
        ckpt.reader.tensor("model/w")
    ckpt.index.tensors["model/count"].shards[0] = dataclasses.replace(
        ckpt.index.tensors["model/count"].shards[0], file="../../../sentinel.safetensors")
    with pytest.raises(CheckpointRejected, match="not in the index's file list"):
        ckpt.reader.tensor("model/count")
    _assert_inside(watched, run)


def test_intact_checkpoint_loads_every_piece(run, watched):
    ckpt = open_checkpoint(find_checkpoint(run, warn=pytest.fail))
    assert ckpt.step == 10 and ckpt.meta["position"] == 80
    expected, _ = _state(10)
    torch.testing.assert_close(ckpt.reader.tensor("model/w"), expected["model/w"])
    torch.testing.assert_close(ckpt.reader.tensor("model/count"), expected["model/count"])
    torch.testing.assert_close(ckpt.reader.tensor("model/box"),
                               torch.cat([expected["model/box#a"], expected["model/box#b"]]))
    torch.testing.assert_close(ckpt.reader.tensor("model/flat"),
                               torch.tensor([[0.0, 0, 0], [7, 7, 7]]))


def test_export_command_refuses_a_traversal_with_exit_2(run, tmp_path):
    shutil.rmtree(_step(run, 5))
    CASES["traversal-relative"][0](_step(run, 10))
    proc = subprocess.run([DISTTRAIN, "export", str(run), "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "sentinel.safetensors" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x").exists()


# the trainer's own resume path, end to end: two ranks, a checkpoint every 2 steps

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    state = run_distributed(fit_tiny, 2, args=(4, str(run_dir)),
                            kwargs={"checkpoint": {"every": 2, "keep": 3}}, timeout=120)[0]
    return run_dir, state


def test_resume_skips_a_crafted_checkpoint(trained, tmp_path):
    run_dir = shutil.copytree(trained[0], tmp_path / "run")
    (tmp_path / "sentinel.safetensors").write_bytes(b"never read")
    CASES["traversal-relative"][0](_step(run_dir, 4))
    state = run_distributed(fit_tiny, 2, args=(4, str(run_dir)),
                            kwargs={"checkpoint": {"every": 2, "keep": 3}}, timeout=120)[0]
    for name, tensor in trained[1].items():  # steps 3 and 4 redone from step 2
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6)


def test_train_refuses_a_run_whose_only_checkpoint_is_crafted(trained, tmp_path):
    run_dir = shutil.copytree(trained[0], tmp_path / "run")
    shutil.rmtree(_step(run_dir, 2))
    _edit_index(_step(run_dir, 4), lambda data: next(iter(data["tensors"].values()))
                .__setitem__("dtype", "float128"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    # the fixture's vocabulary is smaller than the byte corpus the command line would
    # train on: raise it, so that the checkpoint is the first thing refused
    proc = subprocess.run([DISTTRAIN, "train", "--run-dir", str(run_dir), "--set",
                           "model.vocab_size=256"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "index.json" in proc.stderr
    assert "unknown dtype 'float128'" in proc.stderr
