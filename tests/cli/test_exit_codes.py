"""Exit codes: a diverging run, through torch's elastic agent, exits with EXIT_DIVERGED
and keeps its last finite checkpoint as ``latest`` (its restarts, under --max-restarts,
stop at once); the launcher passes the workers' own stop codes through."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_cli import TINY, run_cli

from disttrain.checkpoint import find_checkpoint, open_checkpoint
from disttrain.cli import main
from disttrain.errors import EXIT_DIVERGED, EXIT_SAVE_FAILED, EXIT_USAGE, CheckpointSaveError

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check


@pytest.fixture
def cache_env(tmp_path_factory):
    import os

    env = dict(os.environ, DISTTRAIN_CACHE=str(tmp_path_factory.mktemp("cache")))
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def test_a_diverging_run_exits_diverged_and_keeps_its_last_finite_checkpoint(cache_env,
                                                                             tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["train", "--nproc", "2", *TINY, "--set", "train.steps=6",
                    "--set", "train.lr=1e4", "--set", "train.grad_clip=0",
                    "--set", "checkpoint.every=1", "--set", "train.log_every=1",
                    "--max-restarts", "2", "--run-dir", str(run_dir), "--quiet"], cache_env)
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    diverged = re.search(r"training diverged at step (\d+)", proc.stderr)
    assert diverged and proc.stderr.count("training diverged") == 1, proc.stderr[-3000:]
    # the elastic agent's restarts stop at once instead of diverging again
    for attempt in (1, 2):
        assert f"not restarting (restart {attempt})" in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "model.safetensors").exists()
    # latest: the newest checkpoint before the bad step, saved from a finite state
    found = find_checkpoint(run_dir, warn=pytest.fail)
    assert found.name == (run_dir / "checkpoints" / "latest").read_text().strip()
    checkpoint = open_checkpoint(found)
    assert 1 <= checkpoint.step < int(diverged.group(1))
    reader = checkpoint.reader
    assert all(torch.isfinite(reader.tensor(n)).all() for n in reader.names("model/"))

    def refuse(token):
        raise ValueError(token)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("codes, expected", [
    ({0: EXIT_DIVERGED, 1: EXIT_DIVERGED}, EXIT_DIVERGED),
    ({0: EXIT_SAVE_FAILED, 1: -15}, EXIT_SAVE_FAILED),  # the agent stopped rank 1
    ({0: EXIT_USAGE}, EXIT_USAGE),
    ({0: EXIT_DIVERGED, 1: 1}, 1),
    ({0: 86}, 1),
    ({0: 75, 1: -15}, 75),  # a hang: the watchdog's code
    ({0: 75, 1: 1}, 75),  # a hang beside another failure is still a hang
    ({0: 130, 1: 130}, 130),  # SIGINT to the workers alone
])
def test_launcher_returns_the_workers_own_stop_code(monkeypatch, codes, expected):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from disttrain.launch.agent import LaunchOptions, launch

    def fail(_args):
        raise ChildFailedError("w", {r: ProcessFailure(r, 1, c, "") for r, c in
                                     codes.items()})
    monkeypatch.setattr(torchrun, "run", fail)
    assert launch(LaunchOptions(nproc=len(codes)), ["-m", "disttrain"]) == expected


def test_a_worker_exits_with_the_stop_code_and_one_line(monkeypatch, capsys):
    import disttrain.train as train

    def save_fails(*_a, **_k):
        raise CheckpointSaveError("checkpoint step 4: rank 1 could not write F: full")
    monkeypatch.setattr(train, "train_default", save_fails)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--set", "train.steps=1"]) == EXIT_SAVE_FAILED
    assert capsys.readouterr().err == ("disttrain: error: checkpoint step 4: rank 1 could "
                                       "not write F: full\n")
