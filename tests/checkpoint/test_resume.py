"""Exact resume, resharding across world sizes, and crash safety of saves."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support import fit_tiny

from disttrain.checkpoint import find_checkpoint, open_checkpoint
from disttrain.faults import FAULT_ENV, FAULT_EXIT_CODE
from disttrain.testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

CKPT = {"every": 5, "keep": 2, "async": True}
SYNC = {**CKPT, "async": False}
STEPS = 20


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory):
    """20 uninterrupted steps at world size 2 with synchronous saves."""
    return run_distributed(fit_tiny, 2, args=(STEPS, str(tmp_path_factory.mktemp("sref"))),
                           kwargs={"checkpoint": SYNC}, timeout=120)[0]


def _states_equal(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def _crash(run_dir, world_size, monkeypatch, fault, checkpoint=CKPT, **train) -> None:
    monkeypatch.setenv(FAULT_ENV, fault)
    # the crashed rank's exit, or a peer noticing it first
    died = f"exit code {FAULT_EXIT_CODE}|exit code 1|Connection|peer"
    with pytest.raises(DistributedTestError, match=died):
        run_distributed(fit_tiny, world_size, args=(STEPS, str(run_dir)),
                        kwargs={"checkpoint": checkpoint, **train}, timeout=120)
    monkeypatch.delenv(FAULT_ENV)


@pytest.fixture(scope="module")
def crashed_at_four(tmp_path_factory):
    """A world-4 run killed after step 13 (checkpoints every 5 steps, async)."""
    run_dir = tmp_path_factory.mktemp("crashed")
    with pytest.MonkeyPatch.context() as mp:
        _crash(run_dir, 4, mp, "train.step:13", log_every=1)
    return run_dir


def _resume(run_dir, world_size, checkpoint=CKPT) -> dict:
    return run_distributed(fit_tiny, world_size, args=(STEPS, str(run_dir)),
                           kwargs={"checkpoint": checkpoint}, timeout=120)[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 20 steps at world size 4, never interrupted; its per-step losses."""
    run_dir = tmp_path_factory.mktemp("ref")
    state = run_distributed(fit_tiny, 4, args=(STEPS, str(run_dir)),
                            kwargs={"checkpoint": CKPT, "log_every": 1}, timeout=120)[0]
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl")
                                                 .read_text().splitlines())}
    return state, losses


def test_interrupted_run_resumes_exactly(uninterrupted, crashed_at_four, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(crashed_at_four, run_dir)
    # the async save of step 10 may or may not have committed before the crash
    assert find_checkpoint(run_dir, warn=print).name in ("step-00000005", "step-00000010")
    state = run_distributed(fit_tiny, 4, args=(STEPS, str(run_dir)),
                            kwargs={"checkpoint": CKPT, "log_every": 1}, timeout=120)[0]
    _states_equal(state, uninterrupted[0], atol=1e-6)


@pytest.mark.parametrize("new_world", [2, 1])
def test_saved_at_four_resumes_at_fewer_ranks(uninterrupted, crashed_at_four, tmp_path,
                                              new_world):
    run_dir = tmp_path / f"at{new_world}"
    shutil.copytree(crashed_at_four, run_dir)
    state = run_distributed(fit_tiny, new_world, args=(STEPS, str(run_dir)),
                            kwargs={"checkpoint": CKPT, "log_every": 1}, timeout=120)[0]
    _states_equal(state, uninterrupted[0], atol=1e-4)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none lost or doubled
    for r in records[10:]:
        assert r["loss"] == pytest.approx(uninterrupted[1][r["step"]], abs=1e-4)
    index = open_checkpoint(find_checkpoint(run_dir, warn=print)).index
    assert index.meta["world_size"] == new_world and index.meta["position"] == STEPS * 8


@pytest.mark.parametrize("stage", ["save.before_tensors", "save.mid_file",
                                   "save.before_rename", "save.before_pointer"])
def test_a_crash_at_any_stage_of_a_save_keeps_the_previous_checkpoint(
        stage, sync_reference, tmp_path, monkeypatch):
    _crash(tmp_path, 2, monkeypatch, f"{stage}:10", checkpoint=SYNC)
    found = find_checkpoint(tmp_path, warn=pytest.fail)
    assert found.name == "step-00000005"  # intact, checksums verified
    _states_equal(_resume(tmp_path, 2, SYNC), sync_reference, atol=1e-6)
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_zero3_checkpoint_resumes_under_zero1_and_unsharded(uninterrupted_zero, tmp_path,
                                                            monkeypatch):
    """Saved under ZeRO-3 at 4 ranks; resumed under ZeRO-1 at 2 and without sharding at
    1 rank: the same final parameters as the uninterrupted ZeRO-3 run."""
    saved = tmp_path / "saved"
    _crash(saved, 4, monkeypatch, "train.step:13", zero=3)
    for world, stage in ((2, 1), (1, 0)):
        run_dir = tmp_path / f"z{stage}w{world}"
        shutil.copytree(saved, run_dir)
        state = run_distributed(fit_tiny, world, args=(STEPS, str(run_dir)),
                                kwargs={"checkpoint": CKPT, "zero": stage}, timeout=120)[0]
        _states_equal(state, uninterrupted_zero, atol=1e-4)


@pytest.fixture(scope="module")
def uninterrupted_zero(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("refz")
    return run_distributed(fit_tiny, 4, args=(STEPS, str(run_dir)),
                           kwargs={"checkpoint": CKPT, "zero": 3}, timeout=120)[0]
