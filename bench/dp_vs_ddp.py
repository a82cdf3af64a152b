"""disttrain's data parallelism against torch's DistributedDataParallel, same everything.

    python bench/dp_vs_ddp.py [--reps 5] [--steps 10] [--bucket-mb 4] [--d-model 256]

Two Gloo ranks (one thread each) hold two identically initialised copies of the GPT:
one wrapped by ``apply_data_parallel``, one by ``DistributedDataParallel``, with the
same bucket size and AdamW. After warmup, repetitions alternate (disttrain, DDP,
disttrain, ...) so drifting machine load hits both alike. A step is zero_grad, forward,
loss, backward, gradient sync, optimizer step; its time is the slower rank's. Prints one
JSON line with the median step time of each and their ratio.
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
from disttrain.parallel.data import apply_data_parallel
from disttrain.testing import run_distributed

WARMUP_STEPS = 3
Step = Callable[[torch.Tensor, torch.Tensor], None]


def _batches(cfg: ModelConfig, micro_batch: int, n: int = 4) -> list[tuple[torch.Tensor, ...]]:
    """``n`` random (input_ids, targets) pairs, [micro_batch, seq_len] each, per rank."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (n, micro_batch, cfg.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _disttrain_step(model: GPT, bucket_mb: float, global_count: int) -> Step:
    dp = apply_data_parallel(model, Communicator(None, CollectiveLedger()),
                             bucket_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        dp.zero_grad()
        loss_sum, _ = token_loss(model(inputs), targets)
        loss_sum.backward()
        dp.finish_gradient_sync(1.0 / global_count)
        opt.step()
    return step


def _ddp_step(model: GPT, bucket_mb: float) -> Step:
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        opt.zero_grad()
        logits = ddp(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        opt.step()
    return step


def _time_steps(step: Step, batches: list, n: int) -> list[float]:
    """Seconds per step, as seen by the slowest rank."""
    times = []
    for i in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step(*batches[i % len(batches)])
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return times


def _bench(cfg: ModelConfig, micro_batch: int, bucket_mb: float, reps: int,
           steps: int) -> dict[str, list[float] | int]:
    torch.manual_seed(0)
    ours_model = GPT(cfg)
    ddp_model = copy.deepcopy(ours_model)
    global_count = micro_batch * cfg.seq_len * dist.get_world_size()
    runners = {"disttrain": _disttrain_step(ours_model, bucket_mb, global_count),
               "ddp": _ddp_step(ddp_model, bucket_mb)}
    batches = _batches(cfg, micro_batch)
    for step in runners.values():
        _time_steps(step, batches, WARMUP_STEPS)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(reps):
        for name, step in runners.items():
            times[name] += _time_steps(step, batches, steps)
    return {**times, "params": sum(p.numel() for p in ours_model.parameters())}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size, MiB, both")
    p.add_argument("--d-model", type=int, default=256, help="GPT width (default 256)")
    p.add_argument("--n-layer", type=int, default=4, help="GPT blocks (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per rank per step")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world_size = 2
    cfg = ModelConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=4,
                      seq_len=args.seq_len)
    result = run_distributed(_bench, world_size, timeout=1800,
                             args=(cfg, args.micro_batch, args.bucket_mb, args.reps,
                                   args.steps))[0]
    ours, ddp = statistics.median(result["disttrain"]), statistics.median(result["ddp"])
    print(json.dumps({
        "bench": "dp_vs_ddp", "world_size": world_size, "backend": "gloo",
        "bucket_mb": args.bucket_mb, "disttrain_step_s": round(ours, 5),
        "ddp_step_s": round(ddp, 5), "ratio": round(ours / ddp, 4), "steps": args.steps,
        "reps": args.reps, "params": result["params"],
        "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
