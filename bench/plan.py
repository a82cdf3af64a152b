"""The planner against real runs on this machine, and its search at trillion scale.

    python bench/plan.py [--steps 10] [--nproc 4] [--global-batch 3072] [--published-only]
                          [--tables A,B]

1. ``disttrain plan calibrate --out <tmp>/cluster.json --nproc 4`` measures this
   machine (until that command exists in this checkout, the script prints one JSON
   line with an ``error`` and exits 1: there is nothing honest to predict with).
2. The tiny GPT (4 blocks, d_model 32, 4 heads, seq_len 16, vocabulary 64, fp32, Gloo,
   one torch thread per rank) trains ``--steps`` steps of global batch 8 in micro-batches
   of 2 in every layout of ``LAYOUTS``: dp, ZeRO-1/2/3, tp, pp at 2 ranks; the same at 4
   plus tp x pp and dp x tp. The layouts of one world size share one spawn.
3. Each run is compared with the planner's prediction on the calibrated cluster, as
   ``disttrain plan --validate RUN_DIR --cluster cluster.json`` does: per rank, model
   states and activations; the median step time after the first logged step.
4. The search for a 1-trillion-parameter GPT (128 layers, hidden 25600, 160 heads,
   seq 2048, vocabulary 51200) on 3072 A100-80GB (384 nodes of 8), bf16, global batch
   ``--global-batch`` (3072 as in Narayanan et al. 2021), timed (``search_s`` wall,
   ``search_cpu_s`` this process's CPU seconds, which other processes on a shared
   machine do not inflate).

5. Published runs (:mod:`disttrain.plan.published`, :mod:`disttrain.plan.
   published_layouts`), no GPU needed: llm-foundry's A100 and H100 tables,
   Megatron-LM's H100 and A100 scaling tables, torchtitan's Llama 3.1 8B FSDP rows.

Prints one JSON line: ``memory_rel_error_max`` (the largest |predicted / measured - 1|
of model states or activations over every rank of every layout),
``time_rel_error_median`` (the median over layouts of |step time error|), ``layouts``
(each layout's errors and step times), the search's time, size and best layout.
Then one line per published table (``bench: plan-published``, ``table``; alone with
``--published-only``): each row's published and predicted figure and error, the rank
of its published degrees among the planner's candidates (``of``: the groups of
degrees that fit) and its recomputation choice against the planner's; the median and
worst |error|, the rows in the top three, the recomputation choices right; then the
trillion-parameter search's time (``bench: plan-search``). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset

from disttrain.plan import ModelShape, Options, parse_cluster, search
from disttrain.plan.accuracy import validate_run
from disttrain.plan.published import LLM_FOUNDRY_TABLES
from disttrain.plan.published_check import check_table
from disttrain.plan.published_layouts import LAYOUT_TABLES
from disttrain.testing import run_distributed

MODEL = {"vocab_size": 64, "seq_len": 16, "n_layer": 4, "n_head": 4, "d_model": 32}
LAYOUTS = {
    2: {"dp2": {"dp": 2}, "dp2-zero1": {"dp": 2, "zero": 1},
        "dp2-zero2": {"dp": 2, "zero": 2}, "dp2-zero3": {"dp": 2, "zero": 3},
        "tp2": {"tp": 2}, "pp2": {"pp": 2}},
    4: {"dp4": {"dp": 4}, "dp4-zero1": {"dp": 4, "zero": 1},
        "dp4-zero2": {"dp": 4, "zero": 2}, "dp4-zero3": {"dp": 4, "zero": 3},
        "tp4": {"tp": 4}, "pp4": {"pp": 4}, "tp2-pp2": {"tp": 2, "pp": 2},
        "dp2-tp2": {"dp": 2, "tp": 2}},
}
TRILLION = ModelShape(name="gpt-1t", layers=128, hidden=25600, heads=160, seq=2048,
                      vocab=51200)
TRILLION_CLUSTER = "gpu=a100-80gb,gpus_per_node=8,nodes=384"


def _log(msg: str) -> None:
    print(f"[plan bench] {msg}", file=sys.stderr, flush=True)


class RandomTokens(Dataset):
    """Random token windows: {"input_ids": [T], "targets": [T]} (the content does not
    change the work)."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, MODEL["vocab_size"], (n, MODEL["seq_len"] + 1),
                                    generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "targets": self.tokens[i, 1:]}


def calibrate(out: Path, nproc: int) -> str | None:
    """Run ``disttrain plan calibrate``; None when done, else why not."""
    if importlib.util.find_spec("disttrain.plan.calibrate") is None:
        return ("'disttrain plan calibrate' is not in this checkout "
                "(disttrain.plan.calibrate is missing)")
    cmd = [sys.executable, "-m", "disttrain", "plan", "calibrate", "--out", str(out),
           "--nproc", str(nproc)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"'{' '.join(cmd[2:])}' failed with exit code {done.returncode}: {tail}"
    return None


def _train_layouts(root: str, layouts: dict[str, dict], steps: int) -> None:
    """Every layout in this one set of processes, each into its own run directory."""
    from disttrain import Trainer
    from disttrain.config import load_config
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    for name, parallel in layouts.items():
        cfg = load_config(values={
            "model": MODEL, "parallel": parallel, "checkpoint": {"every": 0},
            "train": {"steps": steps, "global_batch": 8, "micro_batch": 2,
                      "grad_accum": None, "warmup_steps": 1, "log_every": 1},
            "monitor": {"peak_tflops": 1.0}})
        torch.manual_seed(0)
        Trainer(GPT(cfg.model), RandomTokens(), token_loss, cfg, run_dir=f"{root}/{name}",
                collate_fn=collate_token_batch, progress=False).fit()


def compare_layouts(root: Path, cluster_file: Path) -> dict[str, dict]:
    """Each run's errors against the prediction on the calibrated cluster."""
    out = {}
    for layouts in LAYOUTS.values():
        for name in layouts:
            report = validate_run(root / name, str(cluster_file))
            t = report["step_time_s"]
            out[name] = {"model_states_rel_error_max": report["model_states_rel_error_max"],
                         "activations_rel_error_max": report["activations_rel_error_max"],
                         "step_time_predicted_s": t["predicted"],
                         "step_time_measured_s": t["measured"],
                         "step_time_rel_error": t["rel_error"]}
    return out


def search_trillion(global_batch: int) -> dict:
    cluster = parse_cluster(TRILLION_CLUSTER)
    start, cpu = time.perf_counter(), time.process_time()
    result = search(TRILLION, cluster, global_batch, Options(precision="bf16"))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    best = result.rows[0].row() if result.rows else None
    return {"search_s": round(seconds, 3), "search_cpu_s": round(cpu, 3),
            "search_considered": result.considered,
            "search_fits": result.considered - sum(result.rejected.values()),
            "search_best": best,
            "search_model_params": TRILLION.num_params(),
            "search_cluster": TRILLION_CLUSTER, "search_global_batch": global_batch}


TABLES = {t.name: t for t in (*LLM_FOUNDRY_TABLES, *LAYOUT_TABLES)}
# llm-foundry's rows all publish the same layout (FSDP over every GPU): ranking it on
# 8 to 64 GPUs says what ranking it on 512 would, for minutes of search less
RANK_UP_TO = {"llm_foundry_a100": 64, "llm_foundry_h100": 64}


def published(global_batch: int, names: list[str]) -> Iterator[dict]:
    """One JSON object per published table of ``names`` (:func:`~disttrain.plan.
    published_check.check_table`), each as soon as it is checked, then the
    trillion-parameter search's time."""
    for name in names:
        table = TABLES[name]
        _log(f"checking {table.name} ({len(table.rows)} rows)")
        yield check_table(table, rank_up_to=RANK_UP_TO.get(name))
    found = search_trillion(global_batch)
    yield {"bench": "plan-search", **{k: found[k] for k in (
        "search_s", "search_cpu_s", "search_considered", "search_fits",
        "search_cluster", "search_global_batch")}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    p.add_argument("--nproc", type=int, default=4, help="ranks calibrate measures (4)")
    p.add_argument("--global-batch", type=int, default=3072,
                   help="sequences per step of the trillion-parameter search (3072)")
    p.add_argument("--keep", type=Path, default=None,
                   help="write the cluster file and the run directories here (a new "
                        "directory) instead of a temporary one, to validate them again")
    p.add_argument("--tables", type=lambda s: s.split(","), default=list(TABLES),
                   help=f"published tables to check, comma-separated (default all: "
                        f"{','.join(TABLES)})")
    p.add_argument("--published-only", action="store_true",
                   help="only the second line: published runs (seconds, no training)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.published_only:
        for line in published(args.global_batch, args.tables):
            print(json.dumps(line), flush=True)
        return 0
    if args.keep is not None and args.keep.exists():
        print(json.dumps({"bench": "plan", "error": f"--keep {args.keep} exists"}))
        return 1
    with tempfile.TemporaryDirectory(prefix="disttrain-plan-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        cluster_file = root / "cluster.json"
        _log("calibrating")
        problem = calibrate(cluster_file, args.nproc)
        if problem:
            print(json.dumps({"bench": "plan", "error": problem}))
            return 1
        for world, layouts in LAYOUTS.items():
            _log(f"training {len(layouts)} layouts on {world} ranks")
            run_distributed(_train_layouts, world, args=(str(root), layouts, args.steps),
                            timeout=600)
        layouts = compare_layouts(root, cluster_file)
        cluster = json.loads(cluster_file.read_text())
    _log("searching")
    found = search_trillion(args.global_batch)
    memory = max(max(v["model_states_rel_error_max"], v["activations_rel_error_max"])
                 for v in layouts.values())
    times = [abs(v["step_time_rel_error"]) for v in layouts.values()
             if v["step_time_rel_error"] is not None]
    print(json.dumps({"bench": "plan", "memory_rel_error_max": memory,
                      "time_rel_error_median": statistics.median(times) if times else None,
                      "layouts": layouts, **found, "steps": args.steps,
                      "cluster": {k: cluster.get(k) for k in ("name", "source")},
                      "machine": f"{os.cpu_count()} cpu cores"}))
    for line in published(args.global_batch, args.tables):
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
