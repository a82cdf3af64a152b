"""Fault tolerance between replica groups (torchft) against plain data parallelism and
against today's restart from a checkpoint.

    python bench/fault_tolerance.py [--steps 150] [--every 50] [--seed 0]

Four runs of the default job (the byte-level GPT on the standard-library corpus, Gloo),
each ``disttrain train --nproc 2``, one thread per rank, ``train.log_every=1``:

- ``plain``: data parallelism over 2 ranks, checkpoints every ``--every`` steps;
- ``restart``: the same with one rank killed after a random step ``K`` (seeded, in the
  second checkpoint interval) and ``--max-restarts 1``: the job restarts from its last
  checkpoint (today's recovery);
- ``ft``: ``parallel.fault_tolerance=replica`` with 2 replica groups of 1 rank (the
  same global batch, the same checkpoints);
- ``ft_kill``: the same with group 1 SIGKILLed after step ``K``; its agent restarts it
  and it heals from group 0.

Figures: ``overhead`` = ft's step time / plain's (``summary.json``'s training time per
step; target <= 1.05); steps lost: for the restart, from its checkpoint to the kill
(its resume line); for ft, the surviving group's steps logged more than once; wall
time lost = the killed run's wall time
minus its clean run's (target for ft: <= 0.25x the restart's); ``ft_missing_s`` = the
surviving group's time in the steps it took without group 1 (from the kill to the
heal, the quorum's wait for the dead group's heartbeat included); torchft's host round trips
per step (``ft_quorum_s_per_step``, ``ft_commit_s_per_step`` from ft's summary). Prints
one JSON line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))
TARGET_OVERHEAD = 1.05
TARGET_WALL_RATIO = 0.25


def _run(run_dir: Path, steps: int, every: int, ft: bool, kill: int | None
         ) -> tuple[float, str]:
    """One job; returns its wall time and its stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [DISTTRAIN, "train", "--nproc", "2", "--quiet", "--run-dir", str(run_dir),
           "--set", f"train.steps={steps}", "--set", f"checkpoint.every={every}",
           "--set", "train.log_every=1", "--set", "train.eval_every=0",
           "--set", "train.eval_samples=32", "--set", "train.warmup_steps=5"]
    if ft:
        cmd += ["--set", "parallel.fault_tolerance=replica", "--set", "parallel.replicas=2"]
    if kill is not None:
        cmd += ["--max-restarts", "1"]
        env["DISTTRAIN_FAULT"] = f"train.step:{kill}" + ("" if ft else "@1")
        env["DISTTRAIN_FAULT_ONCE"] = "1"  # the restart runs clean
        if ft:
            env["DISTTRAIN_FAULT_REPLICA"] = "1"
    started = time.perf_counter()
    out = subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    return time.perf_counter() - started, out.stderr


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps_logged_twice(run_dir: Path) -> int:
    counts = Counter(r["step"] for r in _records(run_dir))
    return sum(n - 1 for n in counts.values())


def _steps_redone(stderr: str, kill: int) -> int:
    """The steps a restart trained again: from its resume line to the kill."""
    found = re.search(r"resuming from \S+ step (\d+)", stderr)
    if found is None:
        raise RuntimeError("the restarted run did not resume from a checkpoint")
    return kill - int(found.group(1))


def _step_time(run_dir: Path) -> float:
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["train_time_s"] / summary["steps"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    kill = random.Random(args.seed).randint(args.every + 1, 2 * args.every - 1)
    walls: dict[str, float] = {}
    logs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="disttrain-ft-") as tmp:
        runs = {name: Path(tmp) / name for name in ("plain", "restart", "ft", "ft_kill")}
        for name, run in runs.items():
            print(f"[fault_tolerance bench] {name}", file=sys.stderr, flush=True)
            kill_here = kill if name in ("restart", "ft_kill") else None
            walls[name], logs[name] = _run(run, args.steps, args.every,
                                           name.startswith("ft"), kill_here)
        ft0, ft_killed = runs["ft"] / "replica-0", runs["ft_kill"] / "replica-1"
        survivor = runs["ft_kill"] / "replica-0"
        overhead = _step_time(ft0) / _step_time(runs["plain"])
        summary = json.loads((ft0 / "summary.json").read_text())
        killed_summary = json.loads((ft_killed / "summary.json").read_text())
        survivor_summary = json.loads((survivor / "summary.json").read_text())
        restart_lost = walls["restart"] - walls["plain"]
        ft_lost = walls["ft_kill"] - walls["ft"]
        print(json.dumps({
            "bench": "fault_tolerance", "steps": args.steps, "checkpoint_every": args.every,
            "kill_after_step": kill,
            "plain_step_s": round(_step_time(runs["plain"]), 4),
            "ft_step_s": round(_step_time(ft0), 4),
            "overhead": round(overhead, 3), "target_overhead": TARGET_OVERHEAD,
            "ft_quorum_s_per_step": round(summary["ft_quorum_s_per_step"], 5),
            "ft_commit_s_per_step": round(summary["ft_commit_s_per_step"], 5),
            "restart_steps_lost": _steps_redone(logs["restart"], kill),
            "ft_steps_lost": _steps_logged_twice(survivor),
            "restart_wall_lost_s": round(restart_lost, 1),
            "ft_wall_lost_s": round(ft_lost, 1),
            "wall_ratio": round(ft_lost / restart_lost, 3) if restart_lost > 0 else None,
            "target_wall_ratio": TARGET_WALL_RATIO,
            "ft_healed_at": killed_summary["ft_healed_at"],
            "ft_short_steps": len(survivor_summary["ft_short_steps"]),
            "ft_missing_s": round(sum(r["step_time_s"] for r in _records(survivor)
                                      if r["step"] in survivor_summary["ft_short_steps"]), 1),
            "walls_s": {k: round(v, 1) for k, v in walls.items()},
            "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
