"""Dynamic load balancing against a static split, and the cost of monitoring.

    python bench/balance.py [--reps 2] [--steps 60] [--slow 2.0]

Each measurement is one run of the default job (``disttrain train --nproc 2``: the
byte-level GPT on the standard-library corpus, Gloo) in a fresh run directory, with
checkpoints off and a small held-out evaluation:

- balance: rank 1 is slowed ``--slow`` times by an injected per-step delay
  (``DISTTRAIN_SLOW=1:FACTOR``: after its backward passes the rank sleeps FACTOR - 1
  times its compute time, so the delay scales with the samples it is given). Throughput
  is training samples per second of the steps' wall time (``summary.json``: samples_seen
  over train_time_s, rank 0: the wall-clock time of the same number of steps, waiting
  for the slow rank included, evaluations not), with
  ``parallel.balance = static`` and ``dynamic``; runs alternate static, dynamic, ... so
  drifting machine load hits both alike.
- monitoring: no slow rank; the default monitoring (the hang watchdog, a metrics record
  with its all-gather every ``train.log_every`` = 10 steps, the straggler detector,
  TensorBoard when installed; ``--log-every`` changes it) against
  everything that can be switched off (``monitor.hang_timeout=0``, one metrics record at
  the end, no TensorBoard). The figure is the loop's wall time (``wall_time_s``: the
  steps, the logging and the two evaluations). The per-rank collective ledger cannot be
  switched off (every collective goes through it), so its cost is measured apart: the
  time of one ``CollectiveLedger.record`` call times the collectives the run issued per
  step, as a fraction of the step time.

Prints one JSON line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from disttrain.comm import CollectiveLedger

TARGET_DYNAMIC = 1.3      # dynamic / static throughput
TARGET_OVERHEAD = 0.02    # fraction of the unmonitored wall time
DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))


def _log(msg: str) -> None:
    print(f"[balance bench] {msg}", file=sys.stderr, flush=True)


def _train(run_dir: Path, steps: int, sets: list[str], env: dict[str, str]) -> dict:
    """One default-job run on 2 ranks; its summary."""
    common = [f"train.steps={steps}", "checkpoint.every=0", "train.eval_samples=32",
              "train.warmup_steps=5"]
    cmd = [DISTTRAIN, "train", "--nproc", "2", "--quiet", "--run-dir", str(run_dir)]
    for s in common + sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, env={**os.environ, **env},
                   stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def _ledger_record_s(n: int = 200_000) -> float:
    """Seconds per ``CollectiveLedger.record`` call (a 1-element tensor payload)."""
    ledger, t = CollectiveLedger(), torch.zeros(1)
    start = time.perf_counter()
    for _ in range(n):
        ledger.record("all_reduce", "dp", t, "bench/balance.py:1")
    return (time.perf_counter() - start) / n


def _alternate(labels: dict[str, tuple[list[str], dict[str, str]]], reps: int, steps: int,
               root: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {k: [] for k in labels}
    for rep in range(reps):
        for label, (sets, env) in labels.items():
            summary = _train(root / f"{label}-{rep}", steps, sets, env)
            out[label].append(summary)
            _log(f"{label} rep {rep}: {summary['samples_seen'] / summary['train_time_s']:.1f} "
                 f"samples/s train, wall {summary['wall_time_s']:.1f}s")
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions (default 2)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    p.add_argument("--slow", type=float, default=2.0, help="slow-down of rank 1 (default 2)")
    p.add_argument("--log-every", type=int, default=10,
                   help="metrics record interval of the monitored runs (default 10)")
    p.add_argument("--parts", default="balance,monitoring",
                   help="which measurements to run (default both)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    slow = {"DISTTRAIN_SLOW": f"1:{args.slow}"}
    with tempfile.TemporaryDirectory(prefix="disttrain-balance-") as tmp:
        root = Path(tmp)
        _train(root / "warmup", 5, [], {})  # corpus preparation, page cache
        parts = args.parts.split(",")
        bal = (_alternate({"static": (["parallel.balance=static", "train.log_every=5"], slow),
                           "dynamic": (["parallel.balance=dynamic", "train.log_every=5"],
                                       slow)}, args.reps, args.steps, root)
               if "balance" in parts else {})
        on = [f"train.log_every={args.log_every}", "monitor.hang_timeout=120"]
        off = [f"train.log_every={args.steps}", "monitor.hang_timeout=0",
               "monitor.tensorboard=false"]
        mon = (_alternate({"monitored": (on, {}), "unmonitored": (off, {})},
                          args.reps, args.steps, root) if "monitoring" in parts else {})
    print(json.dumps({"bench": "balance", "world_size": 2, "backend": "gloo",
                      **_balance_fields(bal, args), **_monitoring_fields(mon, args),
                      "steps": args.steps, "reps": args.reps,
                      "machine": f"{os.cpu_count()} cpu cores"}))


def _balance_fields(bal: dict, args: argparse.Namespace) -> dict:
    if not bal:
        return {}
    rate = {k: statistics.median(s["samples_seen"] / s["train_time_s"] for s in v)
            for k, v in bal.items()}
    return {"slow_factor": args.slow,
            "static_samples_per_s": round(rate["static"], 2),
            "dynamic_samples_per_s": round(rate["dynamic"], 2),
            "dynamic_vs_static": round(rate["dynamic"] / rate["static"], 4),
            "target_dynamic_vs_static": TARGET_DYNAMIC}


def _monitoring_fields(mon: dict, args: argparse.Namespace) -> dict:
    if not mon:
        return {}
    wall = {k: statistics.median(s["wall_time_s"] for s in v) for k, v in mon.items()}
    step_s = statistics.median(s["train_time_s"] / args.steps for s in mon["unmonitored"])
    record_s = _ledger_record_s()
    # every collective of the run, start-up and evaluations included: an upper bound
    per_step = statistics.median(s["collectives"] for s in mon["monitored"]) / args.steps
    return {"log_every": args.log_every,
            "monitored_wall_s": round(wall["monitored"], 3),
            "unmonitored_wall_s": round(wall["unmonitored"], 3),
            "monitoring_overhead": round(wall["monitored"] / wall["unmonitored"] - 1.0, 4),
            "ledger_record_us": round(record_s * 1e6, 3),
            "collectives_per_step": per_step,
            "ledger_overhead_estimate": round(record_s * per_step / step_s, 6),
            "target_monitoring_overhead": TARGET_OVERHEAD}


if __name__ == "__main__":
    main()
