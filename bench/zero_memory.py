"""ZeRO stages 0-3 against torch FSDP2 (``fully_shard``): peak memory per rank, step time.

    python bench/zero_memory.py [--reps 10] [--steps 1] [--d-model 512] [--n-layer 8]

Four Gloo ranks (one torch thread each) train the same GPT, identically initialised, on
the same random tokens with AdamW (weight decay 0, so every system applies the same
update; torch's default implementation for all) and gradient clipping at 1.0, under six
systems: stage 0 (``apply_data_parallel``), stages 1-3 (``apply_zero``), FSDP2
(``fully_shard`` on each block, then the root; fp32, parameters resharded after the
forward: ZeRO-3's counterpart) and FSDP2 with ``reshard_after_forward=False``
(``fsdp2_keep``: parameters kept gathered from the forward to the backward, ZeRO-2's
counterpart).

Peak memory: each system runs alone in a fresh set of 4 processes under torch's
``MemTracker``, a TorchDispatchMode that follows every tensor storage an op returns
from its creation (model construction included) to its finalisation, and storage
resizes (how ZeRO-3 and FSDP2 free and re-gather parameters). After one step (which
creates the optimizer state) the peak restarts from what is live, and the peak of live
tensor bytes over ``--mem-steps`` more steps is taken on each rank; the largest rank
counts. Step time: all five systems live in one set of 4 processes; after warmup,
rotations of ``--steps`` timed steps per system go round the systems so that drifting
load hits all alike; a step is timed on every rank after a barrier and the slowest
rank's time counts. The ranks start as the command line's workers do: spawned, with the
launcher's allocator settings under ``DISTTRAIN_MALLOC=return``
(``disttrain.launch.allocator.allocator_env``; a ``MALLOC_*`` variable set here wins:
``malloc_mmap_threshold`` in the output says which). The tracker counts live
tensors, which the allocator does not change; the step times include its cost.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.config.schema import ModelConfig
from disttrain.launch.allocator import ALLOCATOR_CHOICE_ENV, ALLOCATOR_RETURN, allocator_env
from disttrain.models import GPT, token_loss
from disttrain.parallel.ddp import apply_data_parallel
from disttrain.parallel.zero import apply_zero
from disttrain.testing import run_distributed

WORLD_SIZE = 4
WARMUP_STEPS = 2
SYSTEMS = ("stage0", "stage1", "stage2", "stage3", "fsdp2", "fsdp2_keep")
TARGET_MEMORY = 0.85  # ZeRO-3 peak / FSDP2 peak (issue 44)
TARGET_TIME = 1.0     # ZeRO-3 step / FSDP2 step; ZeRO-2 / FSDP2 without resharding
MiB = 2**20
CPU = torch.device("cpu")
_TOTAL = "Total"  # MemTracker's key for the sum over kinds
Step = Callable[[torch.Tensor, torch.Tensor], float]


def _log(msg: str) -> None:
    print(f"[zero_memory bench] {msg}", file=sys.stderr, flush=True)


def _batches(cfg: ModelConfig, micro_batch: int, n: int = 4) -> list[tuple[torch.Tensor, ...]]:
    """``n`` random (input_ids, targets) pairs, [micro_batch, seq_len] each, per rank."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (n, micro_batch, cfg.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _data_parallel_step(model: GPT, global_count: int, bucket_mb: float) -> Step:
    dp = apply_data_parallel(model, Communicator(None, CollectiveLedger()),
                             bucket_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        dp.zero_grad()
        loss_sum, _ = token_loss(model(inputs), targets)
        loss_sum.backward()
        dp.finish_gradient_sync(1.0 / global_count)
        dp.clip_grad_norm(1.0)
        opt.step()
        return float(loss_sum.detach()) / inputs.numel()
    return step


def _zero_step(model: GPT, global_count: int, stage: int) -> Step:
    names = {id(p): n for n, p in model.named_parameters()}
    zero = apply_zero(model, Communicator(None, CollectiveLedger()), stage, names)
    opt = torch.optim.AdamW(zero.param_groups(0.0), lr=3e-4)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        zero.zero_grad()
        loss_sum, _ = token_loss(model(inputs), targets)
        loss_sum.backward()
        zero.finish_gradient_sync(1.0 / global_count)
        zero.clip_grad_norm(1.0)
        opt.step()
        zero.after_optimizer_step()
        return float(loss_sum.detach()) / inputs.numel()
    return step


def _fsdp2_step(model: GPT, reshard: bool = True) -> Step:
    """FSDP2 in fp32, sharded per block then the root; the mean loss (equal token counts
    on every rank) with FSDP2's averaging gradient reduction is the global mean."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())
    return step


def _build(system: str, cfg: ModelConfig, micro_batch: int, bucket_mb: float) -> Step:
    """A fresh GPT (same seed for every system) wrapped by ``system``; its step."""
    torch.manual_seed(0)
    model = GPT(cfg)
    global_count = micro_batch * cfg.seq_len * dist.get_world_size()
    if system.startswith("fsdp2"):
        return _fsdp2_step(model, reshard=system == "fsdp2")
    stage = int(system.removeprefix("stage"))
    if stage == 0:
        return _data_parallel_step(model, global_count, bucket_mb)
    return _zero_step(model, global_count, stage)


def _peak_memory(system: str, cfg: ModelConfig, micro_batch: int, bucket_mb: float,
                 steps: int) -> dict[str, float | dict[str, float]]:
    """This rank's peak live tensor bytes over ``steps`` steady-state steps of
    ``system``, what was live when they began, and the peak's breakdown by kind.

    Every tensor storage is followed from its creation (model construction included)
    to its finalisation, whichever thread drops it; storage resizes count.
    """
    # the tracker's own gradient hook finds .grad already moved away by ZeRO 2-3's hook
    warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
    batches = _batches(cfg, micro_batch)
    tracker = MemTracker()
    with tracker:  # construction and the first step (the optimizer state appears)
        step = _build(system, cfg, micro_batch, bucket_mb)
        step(*batches[0])
        tracker.reset_mod_stats()  # per-module stats hold one iteration only
    at_begin = tracker.get_tracker_snapshot("current")[CPU][_TOTAL]
    with tracker:  # re-entering restarts the peak from what is live now
        for i in range(steps):
            step(*batches[(i + 1) % len(batches)])
            tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")[CPU]
    return {"peak": peak[_TOTAL] / MiB, "between_steps": at_begin / MiB,
            "at_peak": {getattr(k, "value", k): round(v / MiB, 1) for k, v in peak.items()
                        if v and k != _TOTAL}}


def _time_steps(step: Step, batches: list, first: int, n: int) -> tuple[list[float], float]:
    """Seconds per step as seen by the slowest rank, and the last step's loss."""
    times, loss = [], float("nan")
    for i in range(first, first + n):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(*batches[i % len(batches)])
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return times, loss


def _step_times(cfg: ModelConfig, micro_batch: int, bucket_mb: float, reps: int,
                steps: int) -> dict[str, dict[str, list[float] | float]]:
    """Every system in these processes; rotations go round them. Per system: the
    slowest rank's seconds for each timed step, and the loss of its last step."""
    runners = {s: _build(s, cfg, micro_batch, bucket_mb) for s in SYSTEMS}
    batches = _batches(cfg, micro_batch)
    for step in runners.values():
        _time_steps(step, batches, 0, WARMUP_STEPS)
    out = {s: {"times": [], "loss": float("nan")} for s in SYSTEMS}
    for rep in range(reps):
        for s, step in runners.items():
            times, loss = _time_steps(step, batches, WARMUP_STEPS + rep * steps, steps)
            out[s]["times"] += times
            out[s]["loss"] = loss
        if dist.get_rank() == 0:
            _log(f"timing rep {rep + 1}/{reps}: " + ", ".join(
                f"{s} {statistics.median(out[s]['times']):.3f}s" for s in SYSTEMS))
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10, help="rotations through the systems "
                   "(default 10)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per system per "
                   "rotation (default 1)")
    p.add_argument("--mem-steps", type=int, default=2, help="tracked steps per memory run")
    p.add_argument("--d-model", type=int, default=512, help="GPT width (default 512)")
    p.add_argument("--n-layer", type=int, default=8, help="GPT blocks (default 8)")
    p.add_argument("--n-head", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per rank per step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="stage-0 bucket size, MiB")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cfg = ModelConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head,
                      seq_len=args.seq_len)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    _log(f"GPT {params / 1e6:.1f}M parameters, world size {WORLD_SIZE}")
    memory = {}
    # what the launcher adds for its workers under DISTTRAIN_MALLOC=return (the memory
    # floor is measured with freed buffers returned; the caller's MALLOC_* win)
    workers_env = allocator_env({**os.environ, ALLOCATOR_CHOICE_ENV: ALLOCATOR_RETURN})
    for system in SYSTEMS:
        ranks = run_distributed(_peak_memory, WORLD_SIZE, timeout=1200, env=workers_env,
                                start_method="spawn",  # glibc reads the settings at start
                                args=(system, cfg, args.micro_batch, args.bucket_mb,
                                      args.mem_steps))
        memory[system] = max(ranks, key=lambda r: r["peak"])
        _log(f"memory {system}: peak {memory[system]['peak']:.1f} MiB, between steps "
             f"{memory[system]['between_steps']:.1f} MiB; at the peak (MiB, the tracker's "
             f"own attribution): {memory[system]['at_peak']}")
    timing = run_distributed(_step_times, WORLD_SIZE, timeout=3600, env=workers_env,
                             start_method="spawn",
                             args=(cfg, args.micro_batch, args.bucket_mb, args.reps,
                                   args.steps))[0]
    step_s = {s: statistics.median(timing[s]["times"]) for s in SYSTEMS}
    losses = [timing[s]["loss"] for s in SYSTEMS]
    result = {"bench": "zero_memory", "world_size": WORLD_SIZE, "backend": "gloo"}
    for s in SYSTEMS:
        result[f"{s}_peak_mb"] = round(memory[s]["peak"], 2)
        result[f"{s}_between_steps_mb"] = round(memory[s]["between_steps"], 2)
        result[f"{s}_step_s"] = round(step_s[s], 4)
    result.update({
        "zero3_vs_fsdp2_memory": round(memory["stage3"]["peak"] / memory["fsdp2"]["peak"], 4),
        "zero3_vs_fsdp2_time": round(step_s["stage3"] / step_s["fsdp2"], 4),
        "zero2_vs_fsdp2_keep_memory": round(memory["stage2"]["peak"]
                                            / memory["fsdp2_keep"]["peak"], 4),
        "zero2_vs_fsdp2_keep_time": round(step_s["stage2"] / step_s["fsdp2_keep"], 4),
        "target_memory": TARGET_MEMORY, "target_time": TARGET_TIME,
        "final_loss_spread": float(f"{max(losses) - min(losses):.3g}"),
        "steps": args.steps, "reps": args.reps, "mem_steps": args.mem_steps,
        "params": params, "d_model": args.d_model, "n_layer": args.n_layer,
        "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "machine": f"{os.cpu_count()} cpu cores",
        "malloc_mmap_threshold": (dict(os.environ) | workers_env).get(
            "MALLOC_MMAP_THRESHOLD_", "glibc default")})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
