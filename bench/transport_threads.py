"""The step time with the transport's polling threads lowered (``low``, the default)
against left as torch made them (``keep``): ``DISTTRAIN_TRANSPORT_PRIORITY``,
``disttrain.comm.transport``.

    python bench/transport_threads.py [--steps 12] [--repeats 2] [--worlds 2,4]

The tiny GPT and layouts of ``bench/plan.py`` (dp, ZeRO-1/2/3, tp, pp at 2 ranks; the
same at 4 plus tp x pp and dp x tp), fp32, Gloo, one torch thread per rank, global
batch 8 in micro-batches of 2. Each world's layouts train in one spawn per setting,
the settings alternated ``keep low keep low ...`` (``--repeats`` pairs) so that a
machine's drift weighs on both. Per layout: the median step time of each run (the
first two logged steps skipped), and ``low_over_keep``: the ratio of the settings'
medians over the runs. Prints one JSON line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan import LAYOUTS, _train_layouts  # noqa: E402  (the planner bench's runs)

from disttrain.names import TRANSPORT_PRIORITY_ENV  # noqa: E402
from disttrain.testing import run_distributed  # noqa: E402

SETTINGS = ("keep", "low")


def _median_step(run_dir: Path) -> float:
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f][2:]
    return statistics.median(r["step_time_s"] for r in records)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2, help="keep/low pairs (default 2)")
    p.add_argument("--worlds", type=lambda s: [int(w) for w in s.split(",")],
                   default=sorted(LAYOUTS))
    ns = p.parse_args()
    runs: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for world in ns.worlds:
            for rep in range(ns.repeats):
                for setting in SETTINGS:
                    print(f"[transport bench] world {world}, {setting}, pair {rep + 1}",
                          file=sys.stderr, flush=True)
                    os.environ[TRANSPORT_PRIORITY_ENV] = setting  # the forked ranks' too
                    out = Path(root) / f"{world}-{setting}-{rep}"
                    run_distributed(_train_layouts, world,
                                    args=(str(out), LAYOUTS[world], ns.steps), timeout=900)
                    for name in LAYOUTS[world]:
                        runs.setdefault(name, {s: [] for s in SETTINGS})[setting].append(
                            round(_median_step(out / name), 5))
    layouts = {name: {"step_s_keep": r["keep"], "step_s_low": r["low"],
                      "low_over_keep": round(statistics.median(r["low"])
                                             / statistics.median(r["keep"]), 3)}
               for name, r in runs.items()}
    ratios = [v["low_over_keep"] for v in layouts.values()]
    print(json.dumps({"bench": "transport_threads", "steps": ns.steps,
                      "repeats": ns.repeats, "cpu_count": os.cpu_count(),
                      "low_over_keep_median": round(statistics.median(ratios), 3),
                      "low_over_keep_max": max(ratios), "layouts": layouts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
