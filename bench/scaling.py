"""The default job's throughput at 2 ranks against 1 rank computing on one thread.

    python bench/scaling.py [--steps 60] [--reps 2]

Runs ``disttrain train`` (the default job: the byte-level GPT on the standard-library
corpus, Gloo, checkpoints off, a small evaluation) with ``--nproc 1`` and
``OMP_NUM_THREADS=1``, then with ``--nproc 2`` (one thread per rank, the launcher's
share of two cores), alternating ``--reps`` times. Figure: training tokens/s
(``summary.json``: tokens over the training time, evaluations excluded), the median
per setting, and ``speedup`` = 2 ranks / 1 rank. Prints one JSON line; progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))
TARGET = 1.6


def _run(run_dir: Path, nproc: int, steps: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [DISTTRAIN, "train", "--nproc", str(nproc), "--quiet", "--run-dir", str(run_dir),
           "--set", f"train.steps={steps}", "--set", "checkpoint.every=0",
           "--set", "train.eval_samples=32", "--set", "train.warmup_steps=5"]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    rates: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="disttrain-scaling-") as tmp:
        for rep in range(args.reps):
            for nproc in (1, 2):
                print(f"[scaling bench] rep {rep + 1}, {nproc} rank(s)", file=sys.stderr,
                      flush=True)
                rates[nproc].append(_run(Path(tmp) / f"r{rep}-{nproc}", nproc, args.steps))
    one, two = (statistics.median(rates[n]) for n in (1, 2))
    print(json.dumps({"bench": "scaling", "tokens_per_s_1_rank_1_thread": round(one, 1),
                      "tokens_per_s_2_ranks": round(two, 1), "speedup": round(two / one, 3),
                      "target_speedup": TARGET, "runs": {str(k): v for k, v in rates.items()},
                      "steps": args.steps, "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
