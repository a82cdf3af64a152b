"""Communication efficiency: gradient codecs and synchronisation modes against the
every_step / uncompressed baseline.

    python bench/comm.py [--steps 250] [--nproc 4] [--global-batch 24] [--sync-every 50]
                         [--codecs fp16,...] [--modes local_sgd,diloco,...]
                         [--variants powersgd_batched,diloco_bf16,update_topk,...]

Each measurement is one run of the default job (``disttrain train --nproc N``: the
byte-level GPT on the standard-library corpus, Gloo) in a fresh run directory, with
checkpoints off, the same seed, ``--steps`` optimizer steps of ``--global-batch``
samples (so every run sees the same number of samples) and the same held-out samples.
Codec runs use ``train.sync=every_step``; mode runs use ``comm.codec=none``; the
variants are ``powersgd_batched`` (powersgd with ``comm.powersgd_batched=true``),
``diloco_bf16`` (DiLoCo with its pseudo-gradient through ``comm.codec=bf16``) and
``update_topk`` / ``update_onebit`` (local_sgd with H = 1 and the codec: each rank's
AdamW update is compressed, with error feedback, instead of its gradient) and
``onebit_adam`` (``train.optimizer=onebit_adam``: AdamW for the default freeze_step,
15% of the run, then the momentum in sign bits; its ``after_warmup_bytes_reduction``
compares the baseline's wire bytes per step with its own over the metrics windows after
the freeze) and ``onebit_adam_zero1`` (the same with ``parallel.zero=1``; ZeRO-1's
reduce-scatter and all-gather move what the baseline's all-reduce moves). From each
run's ``summary.json`` (rank 0):

- wire bytes per step: ``comm_wire_bytes_per_step``, what one rank sends per step for
  the collectives of the steps and their synchronisation, as their algorithms move it
  (a ring all-reduce 2 (N-1)/N of its payload, an all-gather (N-1) payloads; see
  ``disttrain.comm.collectives.wire_bytes``; async: averaged over all ranks);
- payload bytes per step: ``comm_bytes_per_step``, the tensors handed to those
  collectives (async: half of the ledgers' send + receive total);
- step time: ``train_time_s`` / steps (async: the loop's wall time / equivalent steps);
- held-out loss: ``final_eval_loss`` of the final model.

Prints one JSON line: ``bytes_reduction`` (baseline wire bytes / its wire bytes, what
the targets judge), ``payload_reduction`` (the same for payload bytes) and
``loss_ratio`` (its loss / baseline loss), each keyed by codec or mode name, plus
``wire_bytes_per_step``, ``payload_bytes_per_step``, ``step_time_s``, ``eval_loss``,
the targets and the settings.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CODECS = ("none", "fp16", "bf16", "topk", "randomk", "powersgd", "onebit", "qsgd")
MODES = ("local_sgd", "diloco", "async", "fedavg")
# (sync_every for these is --sync-every unless they set it)
VARIANTS = {"powersgd_batched": ["train.sync=every_step", "comm.codec=powersgd",
                                 "comm.powersgd_batched=true"],
            "diloco_bf16": ["train.sync=diloco", "comm.codec=bf16"],
            # each rank's AdamW update compressed every step (local_sgd, H = 1)
            "update_topk": ["train.sync=local_sgd", "train.sync_every=1", "comm.codec=topk"],
            "update_onebit": ["train.sync=local_sgd", "train.sync_every=1",
                              "comm.codec=onebit"],
            # 1-bit Adam: AdamW for train.freeze_step (15% of the run), then the
            # momentum averaged in sign bits
            "onebit_adam": ["train.sync=every_step", "comm.codec=none",
                            "train.optimizer=onebit_adam"],
            # the same over ZeRO-1: each shard's owner keeps its momentum exactly
            "onebit_adam_zero1": ["train.sync=every_step", "comm.codec=none",
                                  "train.optimizer=onebit_adam", "parallel.zero=1"]}
# name -> (minimum bytes_reduction on the wire, maximum loss_ratio)
# (the margins: codecs 3%, local_sgd and diloco 5%, async and fedavg 10%)
TARGETS = {**{c: (None, 1.03) for c in CODECS[1:]},
           "powersgd": (50.0, 1.03), "topk": (50.0, 1.03), "diloco": (50.0, 1.05),
           "local_sgd": (None, 1.05), "async": (None, 1.10), "fedavg": (None, 1.10),
           "powersgd_batched": (50.0, 1.03), "diloco_bf16": (50.0, 1.05),
           "update_topk": (50.0, 1.03), "update_onebit": (None, 1.03),
           "onebit_adam": (5.0, 1.03), "onebit_adam_zero1": (5.0, 1.03)}
# name -> minimum bytes_reduction on the wire over the steps after a warmup
AFTER_WARMUP_TARGETS = {"onebit_adam": 20.0, "onebit_adam_zero1": 20.0}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=250,
                   help="optimizer steps per run (250: the default job's)")
    p.add_argument("--nproc", type=int, default=4, help="ranks (world size)")
    p.add_argument("--global-batch", type=int, default=24,
                   help="samples per step (divisible by nproc and by nproc - 1 for async)")
    p.add_argument("--sync-every", type=int, default=50, help="H for local_sgd/diloco/fedavg")
    p.add_argument("--eval-samples", type=int, default=256)
    p.add_argument("--codecs", default=",".join(CODECS[1:]))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra settings for every run")
    return p.parse_args()


def disttrain_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("disttrain")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "disttrain"]


def run_job(args: argparse.Namespace, name: str, settings: list[str]) -> dict:
    """One training run; its summary."""
    base = [f"train.steps={args.steps}", f"train.global_batch={args.global_batch}",
            "checkpoint.every=0", f"train.eval_samples={args.eval_samples}",
            f"train.log_every={max(1, args.steps // 5)}", *args.set]
    with tempfile.TemporaryDirectory(prefix=f"bench-comm-{name}-") as tmp:
        cmd = [*disttrain_cmd(), "train", "--nproc", str(args.nproc), "--quiet",
               "--run-dir", tmp]
        for item in base + settings:
            cmd += ["--set", item]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        summary["records"] = [r for r in map(json.loads, lines) if "step" in r]
    print(f"{name}: {time.perf_counter() - start:.0f}s, "
          f"{summary['comm_wire_bytes_per_step']:.0f} wire B/step, held-out loss "
          f"{summary['final_eval_loss']:.4f}", file=sys.stderr)
    return summary


def measure(summary: dict, warmup: int, every: int) -> dict:
    """The run's figures; ``wire_after_warmup``: wire bytes per step over the metrics
    windows (``every`` steps each) that start at or after step ``warmup``."""
    steps = summary["steps"] - summary.get("start_step", 0)
    later = [r["comm_wire_bytes_per_step"] for r in summary["records"]
             if r.get("comm_wire_bytes_per_step") is not None and r["step"] - every >= warmup]
    return {"bytes": summary["comm_bytes_per_step"],
            "wire": summary["comm_wire_bytes_per_step"],
            "wire_after_warmup": sum(later) / len(later) if later else None,
            "step_s": summary["train_time_s"] / max(steps, 1),
            "loss": summary["final_eval_loss"]}


def main() -> None:
    args = parse_args()
    runs: dict[str, list[str]] = {"baseline": ["train.sync=every_step", "comm.codec=none"]}
    for codec in filter(None, args.codecs.split(",")):
        if codec != "none":
            runs[codec] = ["train.sync=every_step", f"comm.codec={codec}"]
    for mode in filter(None, args.modes.split(",")):
        runs[mode] = [f"train.sync={mode}", "comm.codec=none",
                      f"train.sync_every={args.sync_every}"]
    for name in filter(None, args.variants.split(",")):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; one of {', '.join(VARIANTS)}")
        keys = VARIANTS[name]
        every = [] if any(k.startswith("train.sync_every=") for k in keys) else [
            f"train.sync_every={args.sync_every}"]
        runs[name] = [*keys, *every]
    # 1-bit Adam's warmup: train.freeze_step's default, 15% of the run
    warmup = max(1, round(0.15 * args.steps))
    every = max(1, args.steps // 5)  # run_job's train.log_every
    results = {name: measure(run_job(args, name, s), warmup, every)
               for name, s in runs.items()}
    base = results.pop("baseline")
    out = {
        "bench": "comm", "world_size": args.nproc, "backend": "gloo", "steps": args.steps,
        "global_batch": args.global_batch, "sync_every": args.sync_every,
        "baseline": base,
        "bytes_reduction": {k: base["wire"] / max(v["wire"], 1e-9)  # on the wire
                            for k, v in results.items()},
        "payload_reduction": {k: base["bytes"] / max(v["bytes"], 1e-9)
                              for k, v in results.items()},
        "after_warmup_bytes_reduction": {
            k: base["wire"] / max(results[k]["wire_after_warmup"], 1e-9)
            for k in AFTER_WARMUP_TARGETS if k in results},
        "loss_ratio": {k: v["loss"] / base["loss"] for k, v in results.items()},
        "wire_bytes_per_step": {k: v["wire"] for k, v in results.items()},
        "payload_bytes_per_step": {k: v["bytes"] for k, v in results.items()},
        "step_time_s": {k: v["step_s"] for k, v in results.items()},
        "eval_loss": {k: v["loss"] for k, v in results.items()},
        "targets": {k: {"min_bytes_reduction": b, "max_loss_ratio": ratio,
                        **({"min_after_warmup_bytes_reduction": AFTER_WARMUP_TARGETS[k]}
                           if k in AFTER_WARMUP_TARGETS else {})}
                    for k, (b, ratio) in TARGETS.items() if k in results},
        "machine": f"{os.cpu_count()} cpu cores",
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
