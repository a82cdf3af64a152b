"""A 2-node job on two hosts that are network namespaces joined by a veth pair.

The nodes rendezvous over the link (c10d store on host a). When host b's link goes
down mid-run, both nodes must exit non-zero within ``parallel.timeout_s`` plus a margin
and say why; once the link is back, the same command resumes the run from its last
checkpoint and finishes it. Skipped where namespaces cannot be made (no root, no ip).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns import Host, HostPair, NetnsUnavailable, netns_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))
PORT = 29500  # free: the namespaces are new
TIMEOUT_S = 20  # parallel.timeout_s: a collective over a dead link fails after this
HANG_S = 10  # monitor.hang_timeout, which must stay below parallel.timeout_s
EXIT_MARGIN_S = 30  # teardown after the timeout, on a loaded 2-core machine
TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
        "--set", "model.seq_len=32", "--set", "train.global_batch=8",
        "--set", "train.eval_samples=16", "--set", f"parallel.timeout_s={TIMEOUT_S}",
        "--set", f"monitor.hang_timeout={HANG_S}"]

# each node says it failed: the launcher's line for a failed worker, the agent's error
# when the rendezvous store on the other host cannot be reached, or the hang watchdog's
# line (a worker that exits 75 has said why; the launcher passes its code on silently)
NODE_FAILED = re.compile(r"disttrain: worker failure: rank \d+ \(exit \d+\)"
                         r"|disttrain: lost the rendezvous|disttrain: hang: rank \d+")
# and between them they name the cause: the hang watchdog's diagnosis, Gloo's
# collective timeout, or the kernel giving up on the dead link
NETWORK_CAUSE = re.compile(r"disttrain: hang: rank|Timed out waiting \d+ms"
                           r"|No route to host|Connection timed out|Connection reset")


@dataclass
class Node:
    """One ``disttrain train`` on one host; its output goes to files (no pipe to fill)."""

    name: str
    proc: subprocess.Popen
    stderr_path: Path
    exited_after: float | None = None

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return f"--- node {self.name} stderr (tail) ---\n{self.stderr[-chars:]}"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """The prepared corpus, shared by both hosts (and both tests)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def hosts(request) -> HostPair:
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"two-host test: {reason}")
    pair = HostPair()
    request.addfinalizer(pair.destroy)  # also after a failed create or a hung node
    try:
        pair.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"two-host test: cannot make network namespaces here: {exc}")
    return pair


def _node_env(host: Host, cache_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DISTTRAIN_CACHE=str(cache_dir), GLOO_SOCKET_IFNAME=host.ifname,
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _start_job(hosts: HostPair, run_dir: Path, cache_dir: Path, logs: Path,
               args: list[str]) -> list[Node]:
    """Start node 0 on host a (which hosts the rendezvous store) and node 1 on host b."""
    logs.mkdir(parents=True, exist_ok=True)
    nodes = []
    for rank, host in enumerate((hosts.a, hosts.b)):
        # The host name resolves to 127.0.0.1 in both namespaces: say which node hosts
        # the store, and the address the other host reaches this one at.
        argv = [DISTTRAIN, "train", *TINY, *args, "--nnodes", "2", "--nproc", "1",
                "--rdzv-endpoint", f"{hosts.a.addr}:{PORT}", "--rdzv-id", "netns",
                "--rdzv-conf", f"is_host={int(host is hosts.a)}",
                "--local-addr", host.addr,
                "--max-restarts", "0", "--run-dir", str(run_dir)]
        err = logs / f"{host.netns}.err"
        with open(logs / f"{host.netns}.out", "wb") as out, open(err, "wb") as errf:
            proc = host.popen(argv, env=_node_env(host, cache_dir),
                              stdout=out, stderr=errf, stdin=subprocess.DEVNULL)
        nodes.append(Node("ab"[rank], proc, err))
    return nodes


def _wait_all(nodes: list[Node], within_s: float) -> list[Node]:
    """Wait for every node, at most ``within_s``; the nodes still running."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        for node in nodes:
            if node.exited_after is None and node.proc.poll() is not None:
                node.exited_after = time.monotonic() - start
        if all(n.exited_after is not None for n in nodes):
            return []
        time.sleep(0.1)
    return [n for n in nodes if n.proc.poll() is None]


def _expect_success(nodes: list[Node], within_s: float) -> None:
    """Both nodes exit 0 within ``within_s``."""
    hung = _wait_all(nodes, within_s)
    logs = _logs(nodes)
    assert not hung, f"nodes {[n.name for n in hung]} still running after {within_s}s\n{logs}"
    assert [n.proc.returncode for n in nodes] == [0, 0], logs


def _logs(nodes: list[Node]) -> str:
    return "\n".join(n.tail() for n in nodes)


def _wait_for_file(path: Path, nodes: list[Node], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not path.exists():
        ended = [n.name for n in nodes if n.proc.poll() is not None]
        assert not ended, f"nodes {ended} exited before {path} appeared\n{_logs(nodes)}"
        assert time.monotonic() < deadline, f"no {path} after {within_s}s\n{_logs(nodes)}"
        time.sleep(0.05)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_two_hosts_over_veth(hosts, cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    nodes = _start_job(hosts, run_dir, cache_dir, tmp_path / "logs",
                       ["--set", "train.steps=10", "--quiet"])
    _expect_success(nodes, within_s=150)
    summary = _summary(run_dir)
    assert (summary["world_size"], summary["steps"]) == (2, 10)


STEPS = 400  # seconds of training after the first checkpoint, when the link goes down
EVERY = 5


def test_link_down_mid_run_then_resume(hosts, cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--set", f"train.steps={STEPS}", "--set", f"checkpoint.every={EVERY}",
            "--set", f"train.log_every={EVERY}"]
    nodes = _start_job(hosts, run_dir, cache_dir, tmp_path / "logs-1", args)
    _wait_for_file(run_dir / "checkpoints" / "latest", nodes, within_s=150)
    hosts.b.set_link(up=False)

    within = TIMEOUT_S + EXIT_MARGIN_S
    hung = _wait_all(nodes, within)
    print("exit after link down:", {n.name: n.exited_after for n in nodes})
    logs = _logs(nodes)
    assert not hung, (f"nodes {[n.name for n in hung]} hang: still running {within}s after "
                      f"the link went down\n{logs}")
    for node in nodes:
        assert node.proc.returncode != 0, f"node {node.name} exited 0 on a dead link\n{logs}"
        assert NODE_FAILED.search(node.stderr), f"node {node.name} does not say it failed\n{logs}"
    assert NETWORK_CAUSE.search(nodes[0].stderr + nodes[1].stderr), logs
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()

    hosts.b.set_link(up=True)
    nodes = _start_job(hosts, run_dir, cache_dir, tmp_path / "logs-2", args)
    _expect_success(nodes, within_s=180)
    step = int(latest.removeprefix("step-"))
    assert f"resuming from {latest}: step {step}," in nodes[0].stderr + nodes[1].stderr
    summary = _summary(run_dir)
    assert (summary["world_size"], summary["start_step"], summary["steps"]) == (2, step, STEPS)
