"""parallel.fault_tolerance = replica: replica groups joined by torchft.

The multi-process tests start the lighthouse and the groups through
disttrain.launch.replicas (each group a torchrun of its own), a tiny GPT, a few steps."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import fit_tiny, tiny_config

from disttrain.errors import ConfigError
from disttrain.parallel.ft.replicas import check_lighthouse, config_fingerprint, replica_window
from disttrain.run_checks import resolve

torchft = pytest.importorskip("torchft", reason="needs torchft (pip install 'disttrain[ft]')")

WORKER = Path(__file__).with_name("ft_worker.py")
# the lighthouse's heartbeat and join timeouts (parallel.ft_heartbeat_s): the survivors
# wait this long for a killed group before stepping without it, but a quorum also waits
# only this long for a live group that lags (a loaded machine): shorter risks a
# survivor left out of a quorum and healed, which the kill tests refuse
HEARTBEAT_S = 5.0
FT_KEYS = {"global_batch": 12, "fault_tolerance": "replica", "replicas": 3, "log_every": 2,
           "warmup_steps": 0}


def test_replica_windows_tile_the_global_batch() -> None:
    for batch in (12, 13, 7):
        for count in (1, 2, 3, 5):
            windows = [replica_window(batch, r, count) for r in range(count)]
            starts = [o for o, _ in windows]
            assert starts == sorted(starts) and starts[0] == 0
            assert [o + n for o, n in windows[:-1]] == starts[1:]  # contiguous
            assert sum(n for _, n in windows) == batch
            assert max(n for _, n in windows) - min(n for _, n in windows) <= 1


def test_fingerprint_tells_configs_and_group_sizes_apart() -> None:
    a = config_fingerprint({"train": {"lr": 1e-3}, "explicit": frozenset({"x", "y"})}, 2)
    assert a == config_fingerprint({"train": {"lr": 1e-3}, "explicit": frozenset({"y"})}, 2)
    assert a != config_fingerprint({"train": {"lr": 2e-3}}, 2)
    assert a != config_fingerprint({"train": {"lr": 1e-3}}, 4)


def test_unreachable_lighthouse_is_refused() -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match="parallel.lighthouse.*not reachable"):
        check_lighthouse(f"http://127.0.0.1:{port}", timeout_s=2.0)


def test_cli_refuses_unreachable_lighthouse_with_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "disttrain", "train", "--nproc", "2", "--run-dir",
         str(tmp_path / "run"), "--set", "parallel.fault_tolerance=replica",
         "--set", "parallel.replicas=2", "--set", "parallel.lighthouse=http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "parallel.lighthouse" in out.stderr and "not reachable" in out.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_one_group_on_its_own_needs_the_lighthouse(tmp_path: Path) -> None:
    """A cluster's job per group (DISTTRAIN_REPLICA_GROUP set): --nproc counts this
    group's ranks (1 is not refused for replicas=2) and no lighthouse is started here."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHFT_LIGHTHOUSE"}
    out = subprocess.run(
        [sys.executable, "-m", "disttrain", "train", "--nproc", "1", "--run-dir",
         str(tmp_path / "run"), "--set", "parallel.fault_tolerance=replica",
         "--set", "parallel.replicas=2"],
        capture_output=True, text=True, timeout=120,
        env={**env, "DISTTRAIN_REPLICA_GROUP": "0"})
    assert out.returncode == 2, out.stderr
    assert "parallel.lighthouse" in out.stderr and "on its own" in out.stderr
    assert not (tmp_path / "run").exists()


def test_data_parallelism_inside_a_group_is_refused() -> None:
    cfg = tiny_config(**FT_KEYS)
    with pytest.raises(ConfigError, match="parallel.dp"):
        resolve(cfg, 2)  # 2 ranks per group, tp 1: dp 2 inside the group


def _launch(run: Path, keys: dict, env: dict[str, str] | None = None) -> int:
    """The groups of ``keys`` as `disttrain train` starts them, in a child process (the
    lighthouse too), each group's run directory RUN/replica-I."""
    code = (
        "import json, sys\n"
        "from disttrain.launch.agent import LaunchOptions\n"
        "from disttrain.launch.replicas import launch_replicas, replica_dir\n"
        f"keys = json.loads({json.dumps(json.dumps(keys))})\n"
        "n = keys['replicas'] * keys.get('tp', 1)\n"
        f"sys.exit(launch_replicas(LaunchOptions(nproc=n, max_restarts=2), keys['replicas'],"
        f" '', lambda i: [{str(WORKER)!r}, replica_dir({str(run)!r}, i), json.dumps(keys)],"
        f" {HEARTBEAT_S}))\n")
    tests = str(Path(__file__).parents[2])
    path = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
    full = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], env=full, timeout=240).returncode


def _weights(run: Path, replicas: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(run / f"replica-{i}" / "model.safetensors"))
            for i in range(replicas)]


STEPS = 8  # the runs below: a few steps on each side of the kill
KILL_AT = 3  # replica group 1 is SIGKILLed right after committing this step


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same global batch of 12 on one process (3 micro-batches of 4)."""
    return fit_tiny(STEPS, str(tmp_path_factory.mktemp("one")), mask=True, global_batch=12,
                    grad_accum=3, log_every=2, warmup_steps=0)


@pytest.fixture(scope="module")
def no_failure(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of three groups stepping STEPS without a failure (checked
    bitwise equal across the groups and against one process)."""
    run = tmp_path_factory.mktemp("ft") / "run"
    assert _launch(run, {**FT_KEYS, "steps": STEPS}) == 0
    groups = _weights(run, 3)
    for other in groups[1:]:  # every group applied the same update: bitwise
        assert all(torch.equal(groups[0][k], other[k]) for k in groups[0])
    summary = json.loads((run / "replica-0" / "summary.json").read_text())
    assert summary["ft_short_steps"] == [] and summary["ft_retried_steps"] == 0
    return groups[0]


@pytest.mark.timeout(300)
def test_three_groups_agree_and_match_one_process(
        no_failure: dict[str, torch.Tensor], one_process: dict[str, torch.Tensor]) -> None:
    # only the order of the gradient sums differs, a few float32 ulps per step
    for name, value in no_failure.items():
        torch.testing.assert_close(value, one_process[name], rtol=1e-4, atol=1e-5)


def _records(run: Path, group: int) -> list[dict]:
    lines = (run / f"replica-{group}" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _logged_steps(run: Path, group: int) -> list[int]:
    return [r["step"] for r in _records(run, group)]


def _check_short_steps_named_once(run: Path, group: int, summary: dict) -> None:
    """Each step that ran short is named in one record, the one that logged it (every
    step is logged here), and the summary lists them all."""
    named = [(r["step"], r.get("ft_short_steps", [])) for r in _records(run, group)]
    assert all(short in ([], [step]) for step, short in named), named
    assert [s for _, short in named for s in short] == summary["ft_short_steps"]


@pytest.mark.timeout(300)
def test_killed_group_rejoins_and_survivors_lose_no_step(
        no_failure: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Group 1 of 3 is SIGKILLed after step KILL_AT; its agent restarts it and it heals
    from a live peer (mid-run, or at the end, where the finished groups wait for it).

    Survivors: every step logged once, in order (none taken again after a commit),
    never healed (their state never replaced), only steps after the kill recorded as
    short. All three end bitwise on the same parameters. Against the run without the
    failure: the missing group's share is redistributed, so every step trains the same
    global batch of 12 and the update is the same mean; only the order of the sums
    differs (2 shares instead of 3 for the short steps), a few float32 ulps per step:
    the same tolerance as three groups against one process. The final train loss
    (the last steps' mean, the loss totals every group shares) is the survivors' on
    the healed group too, whether it healed mid-run or at the last step."""
    run = tmp_path / "ft"
    fault = {"DISTTRAIN_FAULT": f"train.step:{KILL_AT}", "DISTTRAIN_FAULT_REPLICA": "1"}
    assert _launch(run, {**FT_KEYS, "steps": STEPS, "log_every": 1}, fault) == 0
    groups = _weights(run, 3)
    for other in groups[1:]:
        assert all(torch.equal(groups[0][k], other[k]) for k in groups[0])
    for name, value in groups[0].items():
        torch.testing.assert_close(value, no_failure[name], rtol=1e-4, atol=1e-5)
    summaries = [json.loads((run / f"replica-{i}" / "summary.json").read_text())
                 for i in range(3)]
    for i in (0, 2):
        assert _logged_steps(run, i) == list(range(1, STEPS + 1))
        assert summaries[i]["ft_healed_at"] is None
        _check_short_steps_named_once(run, i, summaries[i])
        assert summaries[1]["final_train_loss"] == summaries[i]["final_train_loss"]
        # short only after the kill (none at all when group 1 was back in the next
        # quorum: a fast restart heals at KILL_AT before the others step without it)
        assert all(s > KILL_AT for s in summaries[i]["ft_short_steps"])
    # checkpoints are off: the restart begins at step 0, so this state came from a peer
    assert KILL_AT <= summaries[1]["ft_healed_at"] <= STEPS


@pytest.mark.timeout(400)
def test_two_tp_groups_survive_a_kill(one_process: dict[str, torch.Tensor],
                                      tmp_path: Path) -> None:
    """2 replica groups of tp 2 (4 ranks); both ranks of group 1 SIGKILLed after step
    KILL_AT. Group 0 steps on alone (the whole batch, its tp pair's pieces reduced with
    no one), group 1 restarts and heals from it rank by rank (each tp rank from the same
    tp rank of group 0), and both end bitwise equal. Against one process on the same
    global batch: tp's partial sums and the replicas' sums change only the order of
    float32 additions, the tolerance of the three-group test."""
    run = tmp_path / "ft"
    keys = {**FT_KEYS, "replicas": 2, "tp": 2, "steps": STEPS, "log_every": 1}
    fault = {"DISTTRAIN_FAULT": f"train.step:{KILL_AT}", "DISTTRAIN_FAULT_REPLICA": "1"}
    assert _launch(run, keys, fault) == 0
    groups = _weights(run, 2)
    assert all(torch.equal(groups[0][k], groups[1][k]) for k in groups[0])
    for name, value in groups[0].items():
        torch.testing.assert_close(value, one_process[name], rtol=1e-4, atol=1e-5)
    assert _logged_steps(run, 0) == list(range(1, STEPS + 1))
    survivor = json.loads((run / "replica-0" / "summary.json").read_text())
    killed = json.loads((run / "replica-1" / "summary.json").read_text())
    assert survivor["ft_healed_at"] is None
    assert all(s > KILL_AT for s in survivor["ft_short_steps"])
    _check_short_steps_named_once(run, 0, survivor)
    assert KILL_AT <= killed["ft_healed_at"] <= STEPS
