"""disttrain's data parallelism against torch's DistributedDataParallel, same everything.

    python bench/dp_vs_ddp.py [--nproc 2] [--reps 5] [--steps 10] [--bucket-mb 4]
                              [--d-model 256] [--n-layer 4] [--optimizer auto]

``--nproc`` Gloo ranks (one thread each) hold identically initialised copies of the
GPT: one wrapped by ``apply_data_parallel``; one by ``DistributedDataParallel`` with its
defaults (``ddp``: gradients copied out of its buckets after the all-reduce); one by DDP
tuned (``ddp_tuned``: ``gradient_as_bucket_view=True`` and ``static_graph=True``). All
use the same bucket size and the same AdamW implementation: ``--optimizer auto`` first
times DDP's step with the foreach and the fused AdamW and gives every system the faster
one. After warmup, repetitions go round the systems so drifting machine load hits all
alike. A step is zero_grad, forward, loss, backward, gradient sync, optimizer step; its
time is the slowest rank's. Prints one JSON line: each system's median step time,
``ratio`` = disttrain / the better DDP, and the ratio to each DDP. ``local`` steps the
same model on each rank with no communication at all: ``floor_ratio`` = its step / the
better DDP's is the best any data parallelism could reach here. ``phases_s``: each
system's median forward, backward (DDP: its reductions' waits included), sync (disttrain
waiting for its reductions after backward) and optimizer seconds, the slowest rank's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, token_loss
from disttrain.parallel.ddp import apply_data_parallel
from disttrain.testing import run_distributed

WARMUP_STEPS = 3
PHASES = ("forward", "backward", "sync", "optimizer")
# a step returns its phases' seconds: forward (and loss), backward (with the gradient
# hooks and the reductions they start; DDP waits for its buckets at its end), sync
# (waiting for the reductions after backward, and scaling), optimizer (zeroing too)
Step = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]


class _Clock:
    """Seconds between successive marks, by phase."""

    def __init__(self) -> None:
        self.last, self.phases = time.perf_counter(), {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now


def _batches(cfg: ModelConfig, micro_batch: int, n: int = 4) -> list[tuple[torch.Tensor, ...]]:
    """``n`` random (input_ids, targets) pairs, [micro_batch, seq_len] each, per rank."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (n, micro_batch, cfg.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _adamw(model: torch.nn.Module, impl: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=impl == "foreach",
                             fused=impl == "fused" or None)


def _disttrain_step(model: GPT, bucket_mb: float, global_count: int, impl: str) -> Step:
    dp = apply_data_parallel(model, Communicator(None, CollectiveLedger()),
                             bucket_mb=bucket_mb)
    opt = _adamw(model, impl)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        clock = _Clock()
        dp.zero_grad()
        clock.mark("optimizer")
        loss_sum, _ = token_loss(model(inputs), targets)
        clock.mark("forward")
        loss_sum.backward()
        clock.mark("backward")
        dp.finish_gradient_sync(1.0 / global_count)
        clock.mark("sync")
        opt.step()
        clock.mark("optimizer")
        return clock.phases
    return step


def _local_step(model: GPT, global_count: int, impl: str) -> Step:
    """No communication at all: each rank steps on its own. The floor any data
    parallelism can reach on this machine at this world size (same compute, same
    sharing of the cores)."""
    opt = _adamw(model, impl)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        clock = _Clock()
        opt.zero_grad(set_to_none=False)
        clock.mark("optimizer")
        loss_sum, _ = token_loss(model(inputs), targets)
        clock.mark("forward")
        (loss_sum / global_count).backward()
        clock.mark("backward")
        opt.step()
        clock.mark("optimizer")
        return clock.phases
    return step


def _ddp_step(model: GPT, bucket_mb: float, impl: str, tuned: bool) -> Step:
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb,
                                  gradient_as_bucket_view=tuned, static_graph=tuned)
    opt = _adamw(model, impl)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        clock = _Clock()
        opt.zero_grad(set_to_none=not tuned)  # bucket views stay; zeroed in place
        clock.mark("optimizer")
        loss = F.cross_entropy(ddp(inputs).flatten(0, 1), targets.flatten())
        clock.mark("forward")
        loss.backward()
        clock.mark("backward")
        opt.step()
        clock.mark("optimizer")
        return clock.phases
    return step


def _time_steps(step: Step, batches: list, n: int,
                phases: dict[str, list[float]] | None = None) -> list[float]:
    """Seconds per step, as seen by the slowest rank; each phase's seconds (the
    slowest rank's) appended to ``phases``."""
    times = []
    for i in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        parts = step(*batches[i % len(batches)])
        elapsed = torch.tensor([time.perf_counter() - t0]
                               + [parts.get(p, 0.0) for p in PHASES])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed[0]))
        for p, v in zip(PHASES, elapsed[1:].tolist(), strict=False):
            if phases is not None:
                phases.setdefault(p, []).append(v)
    return times


def _faster_adamw(cfg: ModelConfig, micro_batch: int, bucket_mb: float) -> dict:
    """Median step of tuned DDP with the foreach and the fused AdamW (same on all
    ranks: the slowest rank's times)."""
    batches, out = _batches(cfg, micro_batch), {}
    for impl in ("foreach", "fused"):
        torch.manual_seed(0)
        step = _ddp_step(GPT(cfg), bucket_mb, impl, tuned=True)
        _time_steps(step, batches, WARMUP_STEPS)
        out[impl] = statistics.median(_time_steps(step, batches, 3 * WARMUP_STEPS))
    return out


def _bench(cfg: ModelConfig, micro_batch: int, bucket_mb: float, reps: int,
           steps: int, impl: str) -> dict[str, list[float] | int]:
    adamw = _faster_adamw(cfg, micro_batch, bucket_mb) if impl == "auto" else {}
    if adamw:
        impl = min(adamw, key=adamw.get)
    torch.manual_seed(0)
    ours_model = GPT(cfg)
    global_count = micro_batch * cfg.seq_len * dist.get_world_size()
    runners = {"disttrain": _disttrain_step(ours_model, bucket_mb, global_count, impl),
               "ddp": _ddp_step(copy.deepcopy(ours_model), bucket_mb, impl, tuned=False),
               "ddp_tuned": _ddp_step(copy.deepcopy(ours_model), bucket_mb, impl,
                                      tuned=True),
               "local": _local_step(copy.deepcopy(ours_model), global_count, impl)}
    batches = _batches(cfg, micro_batch)
    for step in runners.values():
        _time_steps(step, batches, WARMUP_STEPS)
    times: dict[str, list[float]] = {name: [] for name in runners}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in runners}
    for _ in range(reps):
        for name, step in runners.items():
            times[name] += _time_steps(step, batches, steps, phases[name])
    return {**times, "phases": {name: {p: statistics.median(v) for p, v in ph.items()}
                                for name, ph in phases.items()},
            "params": sum(p.numel() for p in ours_model.parameters()),
            "optimizer": impl, "adamw_probe_s": adamw}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size, MiB, both")
    p.add_argument("--d-model", type=int, default=256, help="GPT width (default 256)")
    p.add_argument("--n-layer", type=int, default=4, help="GPT blocks (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--optimizer", choices=("auto", "foreach", "fused"), default="auto",
                   help="AdamW implementation for every system (auto: DDP's faster)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world_size = args.nproc
    cfg = ModelConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=4,
                      seq_len=args.seq_len)
    result = run_distributed(_bench, world_size, timeout=3600,
                             args=(cfg, args.micro_batch, args.bucket_mb, args.reps,
                                   args.steps, args.optimizer))[0]
    step = {k: statistics.median(result[k])
            for k in ("disttrain", "ddp", "ddp_tuned", "local")}
    best = min(step["ddp"], step["ddp_tuned"])
    print(json.dumps({
        "bench": "dp_vs_ddp", "world_size": world_size, "backend": "gloo",
        "bucket_mb": args.bucket_mb, "disttrain_step_s": round(step["disttrain"], 5),
        "ddp_step_s": round(step["ddp"], 5), "ddp_tuned_step_s": round(step["ddp_tuned"], 5),
        "ratio": round(step["disttrain"] / best, 4),
        "ratio_vs_ddp_default": round(step["disttrain"] / step["ddp"], 4),
        "ratio_vs_ddp_tuned": round(step["disttrain"] / step["ddp_tuned"], 4),
        "local_step_s": round(step["local"], 5),
        "floor_ratio": round(step["local"] / best, 4),
        "phases_s": {name: {p: round(v, 5) for p, v in ph.items()}
                     for name, ph in result["phases"].items()},
        "target_ratio": 0.95, "optimizer": result["optimizer"],
        "adamw_probe_s": {k: round(v, 5) for k, v in result["adamw_probe_s"].items()},
        "steps": args.steps, "reps": args.reps, "params": result["params"],
        "d_model": args.d_model, "n_layer": args.n_layer, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
