"""A run directory has one owner; a resume may not silently change the trajectory."""

from __future__ import annotations

import os
import socket

import pytest
from support import fit_tiny

from disttrain import cli
from disttrain.errors import UserError
from disttrain.train.ownership import RunDirLock


def test_second_run_on_a_locked_directory_exits_2_naming_the_owner(tmp_path, capsys,
                                                                    monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    owner = RunDirLock(run_dir)  # the first run, still going
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    text = tmp_path / "text"  # a small corpus: prepared in no time
    text.mkdir()
    for i in range(4):
        (text / f"{i}.txt").write_text("some words " * 200)
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "cache"))
    try:
        code = cli.main(["train", "--nproc", "1", "--set", "train.steps=2",
                         "--set", f"data.path={text}",
                         "--run-dir", str(run_dir), "--quiet"])
    finally:
        owner.release()
    err = capsys.readouterr().err
    assert code == 2
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_resume_with_another_seed_is_refused_unless_allowed(tmp_path):
    run_dir = str(tmp_path / "run")
    fit_tiny(4, run_dir, checkpoint={"every": 4})
    with pytest.raises(UserError, match=r"train\.seed: 1234 -> 1.*allow_changes"):
        fit_tiny(6, run_dir, checkpoint={"every": 4}, seed=1)
    fit_tiny(6, run_dir, checkpoint={"every": 4, "allow_changes": True}, seed=1)
