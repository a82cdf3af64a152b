"""Fault tolerance between replica groups (torchft) against plain data parallelism and
against today's restart from a checkpoint: steps and wall time lost to a killed replica.

    python bench/fault_tolerance.py [--reps 3] [--steps 110] [--every 50]
                                    [--sample-cost 0.0625] [--seed 0]

Each repetition runs four jobs of the default job's byte-level GPT (shrunk to 2 layers
of width 64, so its own compute is small), ``disttrain train --nproc 2`` with one
thread per rank, checkpoints every ``--every`` steps, in this order:

- ``ft_kill``: ``parallel.fault_tolerance=replica``, 2 replica groups of 1 rank, group 1
  SIGKILLed after step ``K``; its agent restarts it and it heals from group 0;
- ``ft``: the same without the failure;
- ``restart``: data parallelism over 2 ranks, one rank killed after step ``K`` and
  ``--max-restarts 1``: the job restarts from its last checkpoint (today's recovery);
- ``plain``: the same without the failure.

``K`` is drawn per repetition (seeded) in the second checkpoint interval
(``every + 1 .. 2 every - 1``), the same for both killed jobs of a repetition.

The step's cost is a sleep of ``--sample-cost`` seconds per sample a rank trains
(``DISTTRAIN_SAMPLE_COST``: the time a device would take, without taking this
machine's cores, so the other jobs on it move the figures little): with the global
batch of 32 split over 2 ranks, 16 samples each, 1 s per step by default; a group
left alone trains all 32, 2 s. The cost is large beside a process start (a few
seconds), so the restart's redone steps, not start-up noise, decide its loss.

Figures: wall time lost = a killed job's wall time minus the same mode's job without
the failure in the same repetition (the job's wall time: the launch to the last
group's exit); their medians, extremes and the ratio ft / restart of the medians
(target <= 0.25) and of each repetition; steps lost (the restart: from its checkpoint
to the kill; ft: the surviving group's steps logged more than once, target 0); the
overhead, ft's step time / plain's (``summary.json``; target <= 1.05). Prints one JSON
line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))
TARGET_OVERHEAD = 1.05
TARGET_WALL_RATIO = 0.25
MODES = ("ft_kill", "ft", "restart", "plain")  # the order of a repetition's jobs
SMALL_MODEL = ("model.n_layer=2", "model.d_model=64", "model.n_head=2")


def _run(run_dir: Path, args: argparse.Namespace, mode: str, kill: int
         ) -> tuple[float, str]:
    """One job of ``mode``; returns its wall time and its stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTTRAIN_SAMPLE_COST=str(args.sample_cost))
    sets = [*SMALL_MODEL, f"train.steps={args.steps}", f"checkpoint.every={args.every}",
            "train.log_every=1", "train.eval_every=0", "train.eval_samples=32",
            "train.warmup_steps=5"]
    ft = mode.startswith("ft")
    if ft:
        sets += ["parallel.fault_tolerance=replica", "parallel.replicas=2"]
    cmd = [DISTTRAIN, "train", "--nproc", "2", "--quiet", "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)]]
    if mode in ("ft_kill", "restart"):
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


def _summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


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
    summary = _summary(run_dir)
    return summary["train_time_s"] / summary["steps"]


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "runs": [round(v, 2) for v in values]}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _repetition(tmp: Path, args: argparse.Namespace, kill: int) -> dict[str, Any]:
    """The four jobs of one repetition; what each killed job lost."""
    walls, logs, runs = {}, {}, {m: tmp / m for m in MODES}
    for mode in MODES:
        print(f"[fault_tolerance bench] {tmp.name} {mode} (kill after {kill})",
              file=sys.stderr, flush=True)
        walls[mode], logs[mode] = _run(runs[mode], args, mode, kill)
    survivor = runs["ft_kill"] / "replica-0"
    survived = _summary(survivor)
    short = survived["ft_short_steps"]
    return {
        "walls": walls,
        "restart_lost": walls["restart"] - walls["plain"],
        "ft_lost": walls["ft_kill"] - walls["ft"],
        "restart_steps_lost": _steps_redone(logs["restart"], kill),
        "ft_steps_lost": _steps_logged_twice(survivor),
        "ft_healed_at": _summary(runs["ft_kill"] / "replica-1")["ft_healed_at"],
        "ft_short_steps": len(short),
        "ft_missing_s": sum(r["step_time_s"] for r in _records(survivor)
                            if r["step"] in short),
        "overhead": _step_time(runs["ft"] / "replica-0") / _step_time(runs["plain"]),
        "plain_step_s": _step_time(runs["plain"]),
        "quorum_s": _summary(runs["ft"] / "replica-0")["ft_quorum_s_per_step"],
        "commit_s": _summary(runs["ft"] / "replica-0")["ft_commit_s_per_step"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--sample-cost", type=float, default=0.0625,
                   help="seconds of sleep per sample a rank trains (the step's cost)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    draw = random.Random(args.seed)
    kills = [draw.randint(args.every + 1, 2 * args.every - 1) for _ in range(args.reps)]
    loads = [_load()]
    reps = []
    with tempfile.TemporaryDirectory(prefix="disttrain-ft-") as tmp:
        for i, kill in enumerate(kills):
            rep = Path(tmp) / f"rep{i}"
            rep.mkdir()
            reps.append(_repetition(rep, args, kill))
            loads.append(_load())
    restart = [r["restart_lost"] for r in reps]
    ft = [r["ft_lost"] for r in reps]
    ratio = statistics.median(ft) / statistics.median(restart)
    print(json.dumps({
        "bench": "fault_tolerance", "reps": args.reps, "steps": args.steps,
        "checkpoint_every": args.every, "kill_after_step": kills,
        "kill_range": [args.every + 1, 2 * args.every - 1],
        "sample_cost_s": args.sample_cost, "step_cost_s": args.sample_cost * 16,
        "restart_wall_lost_s": _spread(restart), "ft_wall_lost_s": _spread(ft),
        "wall_ratio": round(ratio, 3),
        "wall_ratio_per_rep": [round(f / r, 3) if r > 0 else None
                               for f, r in zip(ft, restart, strict=True)],
        "target_wall_ratio": TARGET_WALL_RATIO, "wall_met": ratio <= TARGET_WALL_RATIO,
        "restart_steps_lost": [r["restart_steps_lost"] for r in reps],
        "ft_steps_lost": [r["ft_steps_lost"] for r in reps],
        "ft_healed_at": [r["ft_healed_at"] for r in reps],
        "ft_short_steps": [r["ft_short_steps"] for r in reps],
        "ft_missing_s": [round(r["ft_missing_s"], 1) for r in reps],
        "overhead": _spread([r["overhead"] for r in reps]),
        "target_overhead": TARGET_OVERHEAD,
        "plain_step_s": round(statistics.median(r["plain_step_s"] for r in reps), 4),
        "ft_quorum_s_per_step": round(statistics.median(r["quorum_s"] for r in reps), 5),
        "ft_commit_s_per_step": round(statistics.median(r["commit_s"] for r in reps), 5),
        "walls_s": [{k: round(v, 1) for k, v in r["walls"].items()} for r in reps],
        "load_1min": loads, "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
