"""Context parallelism: per-rank peak memory of ring attention at cp N against one
process holding the whole sequence, and its step time against a cp that all-gathers
keys and values.

    python bench/context_parallel.py [--seq 8192] [--cp 4] [--time-cp 2 4] [--d-model 64]
                                     [--n-head 4] [--n-layer 4] [--vocab 256] [--reps 3]
    python bench/context_parallel.py --longest [--seq-points 8192 16384 32768]

The model is the built-in GPT at a tiny width and a long sequence (fp32, batch 1, no
dropout), so that activations, which cp splits, dominate the weights, which it does
not: at 8,192 tokens and width 64 a layer's activations are tens of MiB, the whole
model a few MiB. One forward + backward of disttrain's default loss (summed
cross-entropy) is one step.

Memory: each measured step runs under ``torch.profiler`` with ``profile_memory=True``;
the CPU allocator's ``[memory]`` records (every allocation and free, signed bytes)
summed in time order give the peak allocated above what existed when the step began
(the model and its inputs), gradients included. cp 1 is the unchanged model (torch
SDPA) on the whole sequence in one rank; cp N is the model switched to ring attention
(:func:`disttrain.parallel.context.apply_ring_attention`) on each rank's part; the
ratio takes the largest rank's peak. The all-gather baseline's peak (below) is
reported beside it.

Time: torch's own context parallelism
(``torch.distributed.tensor.experimental.context_parallel``) is tried first on a tiny
attention; on the CPU it cannot run (its ring handles the CUDA flash, memory-efficient
and cuDNN attention ops only; SDPA on the CPU calls
``aten._scaled_dot_product_flash_attention_for_cpu``, which DTensor has no rule for),
and the JSON line says so. The baseline is then a cp that all-gathers keys and values
in forward and reduce-scatters their gradients in backward (Llama 3's all-gather
context parallelism), with the ring's own block kernels, block choice and merge, so
that only the communication differs (torch SDPA on each chunk's causal prefix would
need a materialised lower-right mask on the CPU, 35% slower per call here: a weaker
baseline). Rounds alternate the two, ``--reps`` times after a warm-up step each; a
step's time is the slowest rank's; ``ratio`` is the median over rounds of ring /
all-gather within the round (neighbours in time share the machine's load; target
<= 1.0); the losses of the two must agree to fp32 rounding. ``*_cpu_s``: the CPU
seconds of all ranks together (process time, Gloo's threads included), medians: on a
machine shared with other jobs they move less with the load than the wall clock.

``--longest``: per rank at a few sequence lengths, the model's bytes plus the step's
peak (cp 1 = each of 2 ranks holds whole sequences, as data parallelism would; cp 2 =
the two ranks share one), a least-squares line through them (memory is linear in the
sequence: attention keeps O(T) per layer with fused kernels; the largest residual is
reported), and the sequence at which that line reaches half the machine's available
memory (each rank's share). Running such a sequence is not practical here: attention
time grows as T^2 (hours per step at the lengths found).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from cpu_memory import peak_bytes  # noqa: E402 - bench/ is not a package

from disttrain.attention import AttentionSlot
from disttrain.comm import CollectiveLedger, Communicator
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, token_loss
from disttrain.parallel.context import apply_ring_attention, local_positions, split_sequence
from disttrain.parallel.context.kernels import block_backward, block_forward
from disttrain.parallel.context.ring import _block, _merge  # the ring's own block choice
from disttrain.testing import run_distributed

TARGET_PEAK_RATIO = 0.35
TARGET_TIME_RATIO = 1.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--cp", type=int, default=4, help="cp of the memory comparison")
    p.add_argument("--time-cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--reps", type=int, default=7, help="timed rounds")
    p.add_argument("--longest", action="store_true")
    p.add_argument("--seq-points", type=int, nargs="+", default=[8192, 16384, 32768])
    return p.parse_args()


def model_config(args: argparse.Namespace, seq: int) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, seq_len=seq, n_layer=args.n_layer,
                       n_head=args.n_head, d_model=args.d_model, dropout=0.0)


def batch(args: argparse.Namespace, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (1, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def step(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor,
         positions: torch.Tensor | None) -> torch.Tensor:
    """One forward + backward of the summed cross-entropy; the loss."""
    model.zero_grad(set_to_none=True)
    loss, _ = token_loss(model(ids, position_ids=positions), targets)
    loss.backward()
    return loss.detach()


class AllGatherKVFwdReduceScatterDKVBwd(torch.autograd.Function):
    """The baseline: causal attention of the local queries with keys and values
    all-gathered in forward, their gradients reduce-scattered in backward (Llama 3's
    all-gather context parallelism). The same block kernels, block choice and
    log-sum-exp merge as the ring, so only the communication differs: one
    collective per pass, after (forward) or before (backward) all the compute,
    instead of point-to-point messages overlapped with it. q [B, H, 2c, Dh], k, v
    [B, H_kv, 2c, Dh], laid out as the ring's."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                comm: Communicator) -> torch.Tensor:
        blocks = torch.empty(comm.size, 2, *k.shape, dtype=k.dtype)
        comm.all_gather_into(blocks, torch.stack((k, v)).unsqueeze(0))
        scale, c = q.shape[-1] ** -0.5, q.shape[2] // 2
        out = lse = torch.empty(0)
        for src in (comm.rank, *(s for s in range(comm.size) if s != comm.rank)):
            blk = _block(comm.rank, src, c)
            o, lse_o = block_forward(q[:, :, blk.rows], blocks[src, 0][:, :, blk.keys],
                                     blocks[src, 1][:, :, blk.keys], blk.causal, scale,
                                     "fused")
            if src == comm.rank:
                out, lse = o.float(), lse_o.contiguous()
            else:
                _merge(out[:, :, blk.rows], lse[:, :, blk.rows], o, lse_o)
        ctx.save_for_backward(q, blocks, out, lse)
        ctx.comm = comm
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, blocks, out, lse = ctx.saved_tensors
        comm = ctx.comm
        scale, c = q.shape[-1] ** -0.5, q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        dblocks = torch.zeros_like(blocks)
        for src in range(comm.size):
            blk = _block(comm.rank, src, c)
            r, keys = blk.rows, blk.keys
            gq, gk, gv = block_backward(dout[:, :, r], q[:, :, r], blocks[src, 0][:, :, keys],
                                        blocks[src, 1][:, :, keys], out[:, :, r],
                                        lse[:, :, r].contiguous(), blk.causal, scale, "fused")
            dq[:, :, r] += gq
            dblocks[src, 0][:, :, keys] += gk
            dblocks[src, 1][:, :, keys] += gv
        mine = torch.empty_like(blocks[0])
        comm.reduce_scatter(mine.view(-1), dblocks.view(-1))
        return dq, mine[0], mine[1], None


def use_all_gather(model: torch.nn.Module, comm: Communicator) -> None:
    """Every attention slot of ``model`` runs the all-gather baseline over ``comm``."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float) -> torch.Tensor:
        out: torch.Tensor = AllGatherKVFwdReduceScatterDKVBwd.apply(q, k, v, comm)
        return out

    for m in model.modules():
        if isinstance(m, AttentionSlot):
            m.attend = attend


def torch_cp_probe() -> str | None:
    """None if torch's context_parallel runs a causal SDPA here (CPU tensors, Gloo),
    else its error in one line (every rank fails alike, before any message). Run in a
    world of its own: a failure may leave its dispatcher switched on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (torch.randn(1, 2, 8 * dist.get_world_size(), 8) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # the reason is the measurement
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def _slowest(seconds: float, comm: Communicator) -> float:
    t = torch.tensor([seconds])
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(run: Callable[[], object], comm: Communicator) -> tuple[float, float]:
    """(the slowest rank's wall seconds, the CPU seconds of all ranks together) of
    ``run()``; on a shared machine the second moves less with other jobs' load."""
    comm.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    wall = time.perf_counter() - t0
    cpu = torch.tensor([time.process_time() - c0])
    comm.all_reduce(cpu)
    return _slowest(wall, comm), float(cpu)


def _cp_models(args: argparse.Namespace, comm: Communicator, seq: int):
    torch.manual_seed(0)
    base = GPT(model_config(args, seq))
    ring, gathered = copy.deepcopy(base), copy.deepcopy(base)
    apply_ring_attention(ring, comm, seq_len=seq)
    use_all_gather(gathered, comm)
    ids, targets = batch(args, seq)
    part = (split_sequence(ids, comm.size, comm.rank),
            split_sequence(targets, comm.size, comm.rank),
            local_positions(seq, comm.size, comm.rank))
    return base, ring, gathered, (ids, targets), part


def _time_cp(args: argparse.Namespace, comm: Communicator) -> dict:
    _, ring, gathered, _, part = _cp_models(args, comm, args.seq)
    runs = {"ring": lambda: step(ring, *part), "all_gather": lambda: step(gathered, *part)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    losses = {name: run() for name, run in runs.items()}  # warm-up; both the same loss
    for _ in range(args.reps):
        for name, run in runs.items():
            wall, used = _timed(run, comm)
            times[name].append(wall)
            cpu[name].append(used)
    diff = (losses["ring"] - losses["all_gather"]).abs() / losses["all_gather"].abs()
    comm.all_reduce(diff, op=dist.ReduceOp.MAX)
    ring_s, gather_s = statistics.median(times["ring"]), statistics.median(times["all_gather"])
    paired = statistics.median(r / g for r, g in zip(times["ring"], times["all_gather"],
                                                     strict=True))
    return {"ring_s": round(ring_s, 3), "all_gather_s": round(gather_s, 3),
            "ratio": round(paired, 4), "loss_rel_diff": float(diff),
            "ring_cpu_s": round(statistics.median(cpu["ring"]), 3),
            "all_gather_cpu_s": round(statistics.median(cpu["all_gather"]), 3),
            "ring_all_s": [round(t, 3) for t in times["ring"]],
            "all_gather_all_s": [round(t, 3) for t in times["all_gather"]]}


def _memory(args: argparse.Namespace, comm: Communicator, seq: int,
            baseline: bool = False) -> tuple[int, int, int]:
    """(the whole sequence's peak in one rank, the largest rank's ring peak at cp, and
    with ``baseline`` the all-gather's, else 0)."""
    base, ring, gathered, whole, part = _cp_models(args, comm, seq)
    whole_peak = 0
    if comm.rank == 0:
        step(base, *whole, None)  # warm: the allocator, lazy initialisation
        whole_peak, _ = peak_bytes(lambda: step(base, *whole, None))
    comm.barrier()
    peaks = torch.zeros(2, dtype=torch.float64)
    for i, model in enumerate((ring, gathered) if baseline else (ring,)):
        step(model, *part)
        peaks[i], _ = peak_bytes(lambda m=model: step(m, *part))
    comm.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return whole_peak, int(peaks[0]), int(peaks[1])


def _group(size: int) -> Communicator | None:
    """A Communicator over ranks 0 .. size-1 (None on the others); every rank calls."""
    group = dist.new_group(list(range(size)))
    return Communicator(group, CollectiveLedger(), name="cp") if dist.get_rank() < size else None


def _rank_main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    comm = _group(args.cp)
    if comm is not None:
        whole, ring, gathered = _memory(args, comm, args.seq, baseline=True)
        out |= {"cp1_peak_mib": round(whole / 2**20, 1), "ring_peak_mib": round(ring / 2**20, 1),
                "all_gather_peak_mib": round(gathered / 2**20, 1),
                "peak_ratio": round(ring / whole, 4) if whole else None}
    dist.barrier()
    for cp in args.time_cp:
        comm = _group(cp)
        if comm is not None:
            out[f"time_cp{cp}"] = _time_cp(args, comm)
        dist.barrier()
    return out


def _longest_main(args: argparse.Namespace) -> dict:
    """Per rank at each --seq-points length: the model's own bytes (its position table
    grows with the sequence) plus the step's peak, at cp 1 (rank 0 alone) and cp 2."""
    torch.set_num_threads(1)
    comm = Communicator(None, CollectiveLedger(), name="cp")
    points = []
    for seq in args.seq_points:
        model = sum(p.numel() * p.element_size()
                    for p in GPT(model_config(args, seq)).parameters())
        whole, ring, _ = _memory(args, comm, seq)
        points.append({"seq": seq, "model_mib": round(model / 2**20, 1),
                       "cp1_mib": round((model + whole) / 2**20, 1),
                       "cp2_mib": round((model + ring) / 2**20, 1)})
        print(f"seq {seq}: {points[-1]}", file=sys.stderr)
    return {"points": points}


def _fit(points: list[dict], key: str) -> tuple[float, float, float]:
    """Least squares bytes = a + b seq over the points, and the largest residual
    relative to the bytes (how straight the line is)."""
    xs = [p["seq"] for p in points]
    ys = [p[key] * 2**20 for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, max(abs(a + b * x - y) / y for x, y in zip(xs, ys, strict=True))


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def main() -> None:
    args = parse_args()
    common = {"d_model": args.d_model, "n_head": args.n_head, "n_layer": args.n_layer,
              "vocab": args.vocab, "dtype": "fp32", "torch": torch.__version__,
              "machine": f"{os.cpu_count()} cpu cores", "threads_per_rank": 1}
    if args.longest:
        result = run_distributed(_longest_main, 2, args=(args,), timeout=3000,
                                 start_method="fork")[0]
        per_rank = _available_bytes() // 2
        longest, residual = {}, {}
        for key, name in (("cp1_mib", "without_cp"), ("cp2_mib", "cp2")):
            a, b, residual[name] = _fit(result["points"], key)
            longest[name] = int((per_rank - a) / b)
        print(json.dumps({"bench": "context_parallel_longest", **common, **result,
                          "available_gib_per_rank": round(per_rank / 2**30, 2),
                          "longest_seq_extrapolated": longest,
                          "fit_max_rel_residual": residual}))
        return
    torch_cp = run_distributed(torch_cp_probe, 2, timeout=300, start_method="fork")[0]
    world = max([args.cp, *args.time_cp])
    r0 = run_distributed(_rank_main, world, args=(args,), timeout=3000,
                         start_method="fork")[0]
    ratios = {k: v["ratio"] for k, v in r0.items() if k.startswith("time_cp")}
    print(json.dumps({
        "bench": "context_parallel", "seq": args.seq, "cp": args.cp, **common,
        "cp1_peak_mib": r0["cp1_peak_mib"], "ring_peak_mib": r0["ring_peak_mib"],
        "all_gather_peak_mib": r0["all_gather_peak_mib"],
        "peak_ratio": r0["peak_ratio"], "target_peak_ratio": TARGET_PEAK_RATIO,
        "peak_target_met": r0["peak_ratio"] <= TARGET_PEAK_RATIO,
        "torch_context_parallel": torch_cp or "ran (this bench still times the all-gather)",
        "time_baseline": "all_gather_kv",
        **{k: v for k, v in r0.items() if k.startswith("time_cp")},
        "target_time_ratio": TARGET_TIME_RATIO,
        "time_target_met": all(r <= TARGET_TIME_RATIO for r in ratios.values()),
        "memory_method": "torch.profiler profile_memory: CPU allocator records summed in "
                         "time order, peak above the step's start, largest rank"}))


if __name__ == "__main__":
    main()
