"""The transport's polling threads yield to compute (comm.transport): lowered to nice 19
by the function, and by a training run before its first step."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from disttrain.comm.transport import yield_to_compute
from disttrain.testing import run_distributed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="thread priorities are read from /proc (Linux)")


def _niceness() -> dict[str, list[int]]:
    """Each thread name of this process: the nice values of its threads."""
    out: dict[str, list[int]] = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/comm") as f:
                name = f.read().strip()
            out.setdefault(name, []).append(os.getpriority(os.PRIO_PROCESS, int(entry)))
        except OSError:
            continue
    return out


def _lowered() -> dict[str, object]:
    dist.all_reduce(torch.ones(4))
    before = _niceness()
    changed = yield_to_compute()
    return {"before": before, "changed": changed, "after": _niceness(),
            "again": yield_to_compute(), "caller": os.getpriority(os.PRIO_PROCESS, 0)}


def _lowered_then_fit(run_dir: str) -> tuple[dict[str, object], list[int]]:
    """One world for both tests: the function on the default group's poller, then a
    run, whose own groups' pollers start at torch's priority again."""
    return _lowered(), _fit_records_pollers(run_dir)


@pytest.fixture(scope="module")
def world_2(tmp_path_factory) -> list[tuple[dict[str, object], list[int]]]:
    run_dir = tmp_path_factory.mktemp("transport") / "run"
    return run_distributed(_lowered_then_fit, 2, args=(str(run_dir),), timeout=120)


def test_only_the_polling_threads_are_lowered_and_only_once(world_2):
    for rank, _ in world_2:
        pollers = rank["before"]["gloo_tcp_loop"]
        assert pollers and set(pollers) == {0}, rank["before"]
        assert rank["changed"] == len(pollers)
        assert set(rank["after"]["gloo_tcp_loop"]) == {19}
        others = [n for name, ns in rank["after"].items() if name != "gloo_tcp_loop"
                  for n in ns]
        assert set(others) == {0}, rank["after"]  # compute and every other thread as was
        assert rank["again"] == 0 and rank["caller"] == 0


def _fit_records_pollers(run_dir: str) -> list[int]:
    from disttrain import Callback, Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss
    from tests.support import SyntheticTokens, tiny_config

    seen: list[int] = []

    class Pollers(Callback):
        all_ranks = True

        def on_train_start(self, trainer) -> None:
            seen.extend(_niceness().get("gloo_tcp_loop", []))

    cfg = tiny_config(steps=1, tp=2)
    Trainer(GPT(cfg.model), SyntheticTokens(), token_loss, cfg, run_dir=run_dir,
            collate_fn=collate_token_batch, progress=False, callbacks=[Pollers()]).fit()
    return seen


def test_a_run_lowers_every_group_s_polling_thread_before_its_first_step(world_2):
    # tp 2 on 2 ranks: the world's, the mesh's and the control groups' threads
    for _, seen in world_2:
        assert len(seen) >= 2 and set(seen) == {19}, seen


def _kept() -> int:
    dist.all_reduce(torch.ones(4))
    return yield_to_compute()


def test_keep_leaves_the_threads_as_torch_made_them(monkeypatch):
    monkeypatch.setenv("DISTTRAIN_TRANSPORT_PRIORITY", "keep")
    assert run_distributed(_kept, 1, timeout=60) == [0]


def test_a_misspelt_priority_stops_the_cli_before_any_group(tmp_path):
    import subprocess

    env = {**os.environ, "DISTTRAIN_TRANSPORT_PRIORITY": "lowest"}
    done = subprocess.run([sys.executable, "-m", "disttrain", "train", "--run-dir",
                           str(tmp_path / "run"), "--set", "train.steps=1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "DISTTRAIN_TRANSPORT_PRIORITY='lowest'" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before a worker or a run directory
