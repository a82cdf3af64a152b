"""Loader workers (``data.workers``) against loading in the training process.

    python bench/loader.py [--steps 40] [--workers 2] [--fetch-ms 2.0]

Two jobs, each at 2 Gloo ranks with ``data.workers`` 0 and then ``--workers``, runs
alternating so drifting machine load hits both alike:

- ``default``: the default job (the byte-level GPT on the standard-library corpus,
  its shards memory-mapped): a sample is a slice of a mapped file, so there is little
  to take off the critical path;
- ``fetch``: the built-in GPT at the default job's size on random tokens whose every
  sample waits ``--fetch-ms`` before it is returned, the way a sample read from a
  network filesystem or object store waits (the CPU is idle meanwhile).

Figures per job and worker count: the median per-step data wait (``time_data_s`` of
the metrics, rank 0, records after the first) and tokens/s over the training time
(``summary.json``); ``data_wait_reduction`` = wait without workers / wait with them.
Prints one JSON line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from disttrain.testing import run_distributed


def _log(msg: str) -> None:
    print(f"[loader bench] {msg}", file=sys.stderr, flush=True)


class WaitingTokens(Dataset):
    """Random token windows; each sample waits ``fetch_s`` first (remote storage)."""

    def __init__(self, vocab: int, seq_len: int, fetch_s: float, n: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
        self.fetch_s = fetch_s

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(self.fetch_s)
        return {"input_ids": self.tokens[i, :-1], "targets": self.tokens[i, 1:]}


def _config(steps: int, workers: int):
    from disttrain.config import load_config

    return load_config(overrides=[f"train.steps={steps}", "checkpoint.every=0",
                                  "train.eval_samples=32", "train.warmup_steps=5",
                                  "train.log_every=1", f"data.workers={workers}"])


def _run(job: str, run_dir: str, steps: int, workers: int, fetch_s: float) -> None:
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss
    from disttrain.train import train_default

    cfg = _config(steps, workers)
    if job == "default":
        train_default(cfg, run_dir=run_dir, progress=False)
        return
    torch.manual_seed(0)
    data = WaitingTokens(cfg.model.vocab_size, cfg.model.seq_len, fetch_s)
    Trainer(GPT(cfg.model), data, token_loss, cfg, run_dir=run_dir,
            collate_fn=collate_token_batch, progress=False).fit()


def _figures(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
               .splitlines()][1:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"data_wait_s": statistics.median(r["time_data_s"] for r in records),
            "tokens_per_s": summary["tokens_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--fetch-ms", type=float, default=2.0)
    args = p.parse_args()
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="disttrain-loader-") as tmp:
        for job in ("default", "fetch"):
            for workers in (0, args.workers):
                _log(f"{job}, {workers} worker(s)")
                run_dir = Path(tmp) / f"{job}-{workers}"
                run_distributed(_run, 2, args=(job, str(run_dir), args.steps, workers,
                                               args.fetch_ms / 1e3), timeout=600)
                out.setdefault(job, {})[f"workers_{workers}"] = _figures(run_dir)
    for figures in out.values():
        none, some = figures["workers_0"], figures[f"workers_{args.workers}"]
        figures["data_wait_reduction"] = none["data_wait_s"] / max(some["data_wait_s"], 1e-9)
        figures["tokens_per_s_ratio"] = some["tokens_per_s"] / none["tokens_per_s"]
    print(json.dumps({"bench": "loader", **out, "steps": args.steps, "ranks": 2,
                      "workers": args.workers, "fetch_ms": args.fetch_ms,
                      "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
