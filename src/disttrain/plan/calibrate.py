"""``disttrain plan calibrate``: measure this machine and write it as a cluster file
that ``disttrain plan --cluster FILE.json`` reads (:meth:`Cluster.from_json`).

One node of ``nproc`` devices (GPUs, or on a CPU ``nproc`` ranks sharing the cores as
``disttrain train`` would run them):

- ``peak_tflops``: the best matmul rate measured in each precision (a CPU sweeps bf16
  and fp16 only when a probe finds them at least half as fast as fp32; otherwise the
  probe's rate is their peak); ``matmul_efficiency`` and ``kernel_overhead_s``: fitted
  so that :func:`~disttrain.plan.costs.matmul_time` matches every measured shape
  (:func:`~disttrain.plan.fit.fit_matmul`);
- ``attention_efficiency``: causal fused attention against
  :func:`~disttrain.plan.costs.attention_time`, the geometric mean over shapes;
- ``memory_gbps``: a large copy, bytes read + written per second; ``memory_gib``: the
  GPU's memory, or the RAM's share of one rank;
- links: all-reduce, reduce-scatter, all-gather and a point-to-point message at
  several sizes, each fitted to latency + bytes / bandwidth (through the calls' mean on
  a CPU, the batches' median on a GPU: :func:`call_center`); the all-reduce gives
  ``intra_gbps`` (bus bandwidth) and ``intra_latency_s`` (per latency step of
  :func:`~disttrain.plan.costs.ring_time`), the message ``p2p_intra_gbps`` and
  ``p2p_latency_s``. One node: ``inter_*`` are copies of ``intra_*``;
- ``group_links``: the collectives of every group size the planner may use (powers of
  two up to ``nproc``), timed with all such groups of the world running at once; on a
  CPU also in each smaller world (2, 4, ... ranks), because ranks that share cores slow
  each other's collectives;
- framework time: per layer, per micro-batch for the model's ends, per optimizer
  tensor; on a CPU, ``host_cores`` and ``threads_per_rank``, so that ranks beyond the
  cores compute proportionally slower.

Every raw time and every fit is kept under ``measured``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..launch.agent import worker_threads
from ..monitor.peaks import matmul_precision
from ..shape import ModelShape
from ..testing import run_distributed
from .cluster import GROUP_LINK_OPS, Cluster, group_link_key
from .costs import attention_time, ring_bytes_factor, ring_latency_steps
from .fit import MatmulFit, MatmulPoint, fit_line, fit_matmul
from .measure import (
    COLLECTIVES,
    CPU_PROBE,
    Effort,
    collective_sizes,
    device_memory_gib,
    group_sizes,
    link_times,
    matmul_shapes,
    time_attention,
    time_copy,
    time_matmul,
    time_optimizer_tensors,
    time_tiny_layer,
    time_tiny_model,
)
from .work import head_kernel_time, kernel_time_of_layer

# one call after one warm-up: a 16-bit probe on a CPU may be emulated, and slow
_PROBE_EFFORT = Effort(repeats=1, warmup=1, seconds=0.0)


@dataclass(frozen=True, kw_only=True)
class CalibrateOptions:
    out: Path
    nproc: int
    device: torch.device
    quick: bool = False

    @property
    def effort(self) -> Effort:
        return Effort.of(self.quick)


def run_calibrate(ns: argparse.Namespace) -> int:
    opts = calibrate_options(ns.out, ns.nproc, ns.device, ns.quick)
    started = time.monotonic()
    cluster = calibrate(opts)
    text = json.dumps(cluster.to_json(), indent=2) + "\n"
    Cluster.from_json(json.loads(text), str(opts.out))  # what plan --cluster will read
    try:
        opts.out.write_text(text)
    except OSError as exc:
        raise UserError(f"--out {opts.out}: cannot write ({exc})") from None
    print(summary(cluster, time.monotonic() - started))
    print(f"wrote {opts.out} (use: disttrain plan --cluster {opts.out} ...)")
    return 0


def calibrate_options(out: str, nproc: int | None, device: str | None,
                      quick: bool) -> CalibrateOptions:
    """The checked request; every problem is a UserError raised before anything runs."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no GPU is visible to torch; use --device cpu")
    gpus = torch.cuda.device_count() if kind == "cuda" else 0
    nproc = nproc if nproc is not None else (gpus if kind == "cuda" else 2)
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: needs at least 1 rank")
    if kind == "cuda" and nproc > gpus:
        raise UserError(f"--nproc {nproc}: only {gpus} GPU(s) visible; use --nproc {gpus} "
                        "or fewer")
    return CalibrateOptions(out=_writable(Path(out)), nproc=nproc,
                            device=torch.device(kind, 0) if kind == "cuda"
                            else torch.device("cpu"), quick=quick)


def _writable(path: Path) -> Path:
    if path.suffix != ".json":
        raise UserError(f"--out {path}: name it *.json (plan --cluster reads a cluster "
                        "file by that suffix)")
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UserError(f"--out {path}: is a directory; give a file name")
    if not parent.is_dir():
        raise UserError(f"--out {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"--out {path}: not writable; choose another path")
    return path


def calibrate(opts: CalibrateOptions) -> Cluster:
    """Measure, fit, and return the cluster (``measured`` holds every point)."""
    # The collectives first: on a CPU their ranks fork from this process, which must not
    # have started torch's thread pool yet.
    links, link_notes = measure_links(opts)
    threads = torch.get_num_threads()
    if opts.device.type == "cpu":
        torch.set_num_threads(worker_threads(opts.nproc))
    try:
        return _measure_device(opts, links, link_notes)
    finally:
        torch.set_num_threads(threads)


def _measure_device(opts: CalibrateOptions, links: dict[str, Any],
                    link_notes: dict[str, Any]) -> Cluster:
    # memory first: on a GPU, what is in use before this process allocates is reserved
    memory_gib, reserved_gib = device_memory_gib(opts.device, opts.nproc)
    points, probes, probe_notes = _matmuls(opts)
    nbytes, copy_s = time_copy(opts.device, opts.quick, opts.effort)
    host = socket.gethostname()
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    base = Cluster(name=f"calibrated-{host}", gpus_per_node=opts.nproc, nodes=1,
                   peak_tflops=_peaks(points + probes), matmul_efficiency=1.0,
                   attention_efficiency=1.0, memory_gib=memory_gib,
                   reserved_gib=reserved_gib, memory_gbps=nbytes / copy_s / 1e9,
                   source=f"calibrated:{host} {date} (peaks measured, not published)",
                   **(links or _no_links(nbytes / copy_s)))
    fit = fit_matmul(base, points)
    base = replace(base, matmul_efficiency=fit.efficiency, kernel_overhead_s=fit.overhead_s)
    attention_eff, attention_notes = _attention(opts, base)
    base = replace(base, attention_efficiency=attention_eff)
    host_fields, host_notes = _host_overheads(opts, base)
    measured = _machine_notes(opts, host, date) | {
        "matmul": _matmul_notes(points, probes, probe_notes, fit),
        "attention": attention_notes,
        "memory": {"copy_bytes_moved": nbytes, "seconds": copy_s,
                   "gbps": nbytes / copy_s / 1e9,
                   "note": "one large copy: bytes read + written per second, one rank alone"},
        "links": link_notes, "host": host_notes}
    return replace(base, measured=measured, **host_fields)


def _host_overheads(opts: CalibrateOptions, cluster: Cluster
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Framework time beyond the kernels: a tiny transformer layer's forward and
    backward less what the fitted kernel model predicts for it, and the optimizer's
    cost per parameter tensor."""
    dims, layer_s = time_tiny_layer(opts.device, opts.effort)
    model_s = time_tiny_model(opts.device, opts.effort)
    shape = ModelShape(layers=1, hidden=dims["d_model"], heads=dims["n_head"],
                       seq=dims["seq_len"], vocab=dims["vocab_size"], qkv_bias=False)
    bare = replace(cluster, layer_overhead_s=0.0, async_dispatch=False)
    kernels = kernel_time_of_layer(shape, bare, dims["batch"], "fp32")
    ends = head_kernel_time(shape, bare, dims["batch"], "fp32")
    tensors, optimizer_s = time_optimizer_tensors(opts.device, opts.effort)
    cpu = opts.device.type == "cpu"
    fields = {"layer_overhead_s": max(0.0, layer_s - kernels),
              "microbatch_overhead_s": max(0.0, model_s - layer_s - ends),
              "tensor_overhead_s": optimizer_s / tensors,
              "async_dispatch": not cpu,
              "host_cores": (os.cpu_count() or 1) if cpu else 0,
              "threads_per_rank": torch.get_num_threads() if cpu else 1}
    notes = {"tiny_layer": dims, "layer_seconds": layer_s,
             "layer_kernels_predicted_s": kernels, "model_seconds": model_s,
             "head_kernels_predicted_s": ends, "optimizer_tensors": tensors,
             "optimizer_seconds": optimizer_s,
             "note": "layer_overhead_s: a tiny layer's forward + backward less its kernels "
                     "as the fitted model predicts them; microbatch_overhead_s: the same "
                     "model with its embedding, head and loss, less the layer and the "
                     "head's predicted kernels; tensor_overhead_s: clipping, "
                     "AdamW and zeroing per parameter tensor; async_dispatch: the host "
                     "overlaps the device (GPU) or not (CPU)"}
    return fields, notes


def _machine_notes(opts: CalibrateOptions, host: str, date: str) -> dict[str, Any]:
    cpu = opts.device.type == "cpu"
    return {"host": host, "date": date, "torch": torch.__version__, "ranks": opts.nproc,
            "quick": opts.quick,
            "device": f"cpu:{os.cpu_count()} cores" if cpu
            else f"cuda:{torch.cuda.get_device_name(opts.device)}",
            "threads_per_rank": torch.get_num_threads() if cpu else None,
            "fp32_matmul": "fp32" if cpu else matmul_precision("fp32")}


# matmuls and attention ---------------------------------------------------------------

def _matmuls(opts: CalibrateOptions) -> tuple[list[MatmulPoint], list[MatmulPoint],
                                              dict[str, str]]:
    """(points of the swept precisions, probes of the others, why they were not
    swept). A GPU sweeps bf16, fp16 and fp32; a CPU fp32, and a 16-bit precision only
    when a probe reaches half of fp32's peak."""
    shapes = matmul_shapes(opts.device, opts.quick)
    if opts.device.type == "cuda":
        return [time_matmul(opts.device, p, s, opts.effort)
                for p in ("bf16", "fp16", "fp32") for s in shapes], [], {}
    points = [time_matmul(opts.device, "fp32", s, opts.effort) for s in shapes]
    fp32 = _peaks(points)["fp32"]
    probes, notes = [], {}
    for precision in ("bf16", "fp16"):
        probe = time_matmul(opts.device, precision, CPU_PROBE, _PROBE_EFFORT)
        ratio = _peaks([probe])[precision] / fp32
        if ratio >= 0.5:
            points += [time_matmul(opts.device, precision, s, opts.effort) for s in shapes]
            continue
        probes.append(probe)
        notes[precision] = (f"{ratio:.2f} x fp32's peak on {CPU_PROBE}: not swept; its peak "
                            "is this probe's rate")
    return points, probes, notes


def _peaks(points: list[MatmulPoint]) -> dict[str, float]:
    """The best rate measured in each precision, TFLOP/s."""
    peaks: dict[str, float] = {}
    for p in points:
        peaks[p.precision] = max(peaks.get(p.precision, 0.0), p.flops / p.seconds / 1e12)
    return peaks


def _matmul_notes(points: list[MatmulPoint], probes: list[MatmulPoint],
                  probe_notes: dict[str, str], fit: MatmulFit) -> dict[str, Any]:
    rows = [{"precision": p.precision, "m": p.m, "k": p.k, "n": p.n, "seconds": p.seconds,
             "gflops": p.flops / p.seconds / 1e9, "fit_rel_error": err}
            for p, err in zip(points, fit.rel_errors, strict=True)]
    rows += [{"precision": p.precision, "m": p.m, "k": p.k, "n": p.n, "seconds": p.seconds,
              "gflops": p.flops / p.seconds / 1e9, "fit_rel_error": None} for p in probes]
    return {"shapes": "[m, k] x [k, n]: tokens x hidden times hidden x out",
            "points": rows, "not_swept": probe_notes,
            "fit": {"efficiency": fit.efficiency, "kernel_overhead_s": fit.overhead_s,
                    "rms_rel_error": _rms(fit.rel_errors), "points": len(points),
                    "method": "least squares of relative error of estimate.matmul_time, "
                    "peaks fixed at the best rate measured"}}


def _attention(opts: CalibrateOptions, cluster: Cluster) -> tuple[float, dict[str, Any]]:
    """The efficiency at which ``attention_time`` matches the measured shapes best in
    log time (their geometric mean), at most 1."""
    precision = "bf16" if opts.device.type == "cuda" else "fp32"
    points = time_attention(opts.device, precision, opts.quick, opts.effort)
    unit = replace(cluster, attention_efficiency=1.0)
    ideal = [attention_time(unit, p.batch, p.seq, p.heads * p.head_dim, precision)
             for p in points]
    effs = [i / p.seconds for i, p in zip(ideal, points, strict=True)]
    eff = min(1.0, math.exp(statistics.fmean(math.log(e) for e in effs)))
    rows = [{"batch": p.batch, "heads": p.heads, "seq": p.seq, "head_dim": p.head_dim,
             "seconds": p.seconds, "efficiency": e, "fit_rel_error": e / eff - 1}
            for p, e in zip(points, effs, strict=True)]
    return eff, {"precision": precision, "causal": True, "points": rows, "efficiency": eff,
                 "note": "FLOPs as estimate.attention_time counts them (4 b s^2 width, "
                 "causal masking not subtracted), over the measured peak"}


# links --------------------------------------------------------------------------------

def measure_links(opts: CalibrateOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """Cluster link fields from collectives over ``nproc`` ranks, and the notes for
    ``measured``; none (empty) for one rank. Also every group of
    :func:`~disttrain.plan.measure.group_sizes` inside the world (``group_links``); on
    a CPU, whose ranks share cores, inside each smaller world of a power of two ranks
    as well, since how many ranks run changes what a collective costs there."""
    if opts.nproc == 1:
        return {}, {"note": "one rank: no link to measure; intra_* and inter_* are the "
                    "memory copy's bandwidth, unused by plans of one device"}
    sizes = collective_sizes(opts.quick)
    cuda = opts.device.type == "cuda"
    center = call_center(cuda)
    worlds = [opts.nproc] if cuda else group_sizes(opts.nproc)
    group_links: dict[str, dict[str, list[float]]] = {}
    group_notes: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    notes: dict[str, Any] = {}
    for world in worlds:
        per_rank = run_distributed(link_times, world,
                                   args=(sizes, opts.effort, group_sizes(world)),
                                   timeout=120.0 if opts.quick else 300.0,
                                   backend="nccl" if cuda else "gloo",
                                   start_method="spawn" if cuda else "fork")
        whole = [r["world"] for r in per_rank]
        for g in group_sizes(world):
            times = whole if g == world else [r["groups"][g] for r in per_rank]
            key = group_link_key(g, world)
            group_links[key], group_notes[key] = group_fits(sizes, times, center)
        if world == opts.nproc:
            fields, notes = link_fields(sizes, whole, center)
    fields["group_links"] = group_links
    notes["groups"] = group_notes | {
        "note": "'g/w': a group of g ranks while w ranks run (w / g groups at once); "
                "[latency_s, gbps] per call: latency + whole tensor bytes / gbps, the "
                f"slowest rank's call, {center.__name__} over calls (a GPU's calls: "
                "each a batch's mean)"}
    return fields, notes


Center = Callable[[list[float]], float]


def call_center(cuda: bool) -> Center:
    """What stands for a size's calls in the fit. On a GPU each figure is already a
    batch's mean: their median, which one slow batch does not move. On a CPU each
    figure is one call, and the calls are skewed (2 ranks on 2 cores, Gloo's polling
    threads lowered: median 0.31 ms, mean 0.66-0.74 for 4 KiB): a step makes many calls,
    and a sum of many such times sits near the sum of their means, not of their medians
    (the median under-priced every multi-rank layout of ``bench/plan.py`` by 17-61%).
    Their mean, then. With the polling threads left busy (``comm.transport``) the tail
    held 3-4 ms scheduler waits and the mean of 120 calls moved 3x between two
    calibrations; lowered, two calibrations' 2-rank all-reduce latencies came out
    0.46 and 0.48 ms (``bench/README.md``, ``plan.py``)."""
    return statistics.median if cuda else statistics.mean


def group_fits(sizes: list[int], per_rank: list[dict[str, list[list[float]]]],
               center: Center
               ) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """``{op: [latency_s, gbps]}`` of each collective, fitted to ``center`` of its
    calls at each size (each call the slowest rank's: :func:`_slowest_calls`;
    :func:`call_center`), those figures and the calls."""
    fits, notes = {}, {}
    for op in GROUP_LINK_OPS:
        calls = _slowest_calls(op, len(sizes), per_rank)
        typical = [center(c) for c in calls]
        fit = fit_line(sizes, typical)
        fits[op] = [fit.latency_s, fit.gbps]
        notes[op] = {"seconds": typical, "fit_rel_errors": fit.rel_errors, "calls": calls}
    return fits, notes


def _slowest_calls(op: str, n_sizes: int, per_rank: list[dict[str, list[list[float]]]]
                   ) -> list[list[float]]:
    """Per size, each call's time on its slowest rank (on a GPU, each batch's mean)."""
    return [[max(ranks) for ranks in zip(*(r[op][i] for r in per_rank), strict=True)]
            for i in range(n_sizes)]


def link_fields(sizes: list[int], per_rank: list[dict[str, list[list[float]]]],
                center: Center
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit each collective's calls (``center`` of each size's, each call's time the
    slowest rank's) and turn them into cluster fields; ``per_rank``: what
    :func:`~disttrain.plan.measure.collective_times` returned on each rank."""
    n = len(per_rank)
    notes: dict[str, Any] = {"ranks": n, "dtype": "fp32", "sizes_bytes": sizes}
    fits = {}
    for op in COLLECTIVES:
        calls = _slowest_calls(op, len(sizes), per_rank)
        typical = [center(c) for c in calls]
        fits[op] = fit_line(sizes, typical)
        notes[op] = {"seconds": typical, "calls": calls, "latency_s": fits[op].latency_s,
                     "algbw_gbps": fits[op].gbps, "fit_rel_errors": fits[op].rel_errors}
        if op != "p2p":
            notes[op]["busbw_gbps"] = fits[op].gbps * ring_bytes_factor(n, op)
    ar = fits["all_reduce"]
    fields = {"intra_gbps": ar.gbps * ring_bytes_factor(n), "intra_latency_s":
              ar.latency_s / ring_latency_steps(n), "p2p_intra_gbps": fits["p2p"].gbps,
              "p2p_latency_s": fits["p2p"].latency_s,
              "op_gbps": {op: fits[op].gbps * ring_bytes_factor(n, op)
                          for op in ("reduce_scatter", "all_gather")}}
    fields |= {"inter_gbps": fields["intra_gbps"], "inter_latency_s":
               fields["intra_latency_s"], "p2p_inter_gbps": fields["p2p_intra_gbps"]}
    notes["note"] = (f"intra_gbps: all-reduce bus bandwidth (x 2(n-1)/n); intra_latency_s: "
                     f"its latency over {ring_latency_steps(n)} ring steps; p2p: half a "
                     "round trip between ranks 0 and 1; one node: inter_* copy intra_* "
                     "(not measured)")
    return fields, notes


def _no_links(bytes_per_s: float) -> dict[str, Any]:
    gbps = bytes_per_s / 1e9
    return {"intra_gbps": gbps, "inter_gbps": gbps}


# summary ------------------------------------------------------------------------------

def summary(c: Cluster, seconds: float) -> str:
    m = c.measured
    fit = m["matmul"]["fit"]
    peaks = ", ".join(f"{k} {_rate(v * 1e12)}" for k, v in c.peak_tflops.items())
    lines = [f"{c.name}: {c.gpus_per_node} rank(s) on {m['device']}, {seconds:.1f} s",
             f"  matmul peak {peaks}; fit: efficiency {c.matmul_efficiency:.3f}, overhead "
             f"{c.kernel_overhead_s * 1e6:.1f} us, rms error {100 * fit['rms_rel_error']:.0f}% "
             f"over {fit['points']} shapes",
             f"  attention efficiency {c.attention_efficiency:.3f}; memory copy "
             f"{c.memory_gbps:.1f} GB/s; {c.memory_gib:.1f} GiB per rank "
             f"({c.reserved_gib:.1f} reserved)",
             f"  framework: {c.layer_overhead_s * 1e6:.0f} us per layer forward + backward "
             f"beyond its kernels, {c.microbatch_overhead_s * 1e6:.0f} us per micro-batch for "
             f"the model's ends, {c.tensor_overhead_s * 1e6:.0f} us per parameter tensor "
             f"per optimizer step"]
    for precision, why in m["matmul"]["not_swept"].items():
        lines.append(f"  {precision}: {why}; plan with --precision fp32 here")
    if c.gpus_per_node > 1:
        p2p = m["links"]["p2p"]
        lines.append(f"  all-reduce: bus {c.intra_gbps:.2f} GB/s, latency "
                     f"{m['links']['all_reduce']['latency_s'] * 1e6:.0f} us "
                     f"({c.intra_latency_s * 1e6:.0f} us per step); p2p "
                     f"{c.p2p_intra_gbps:.2f} GB/s, latency {p2p['latency_s'] * 1e6:.0f} us")
        lines.append("  bus bandwidth of " + ", ".join(
            f"{op.replace('_', '-')} {gbps:.2f} GB/s" for op, gbps in c.op_gbps.items()))
    return "\n".join(lines)


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def _rms(values: tuple[float, ...]) -> float:
    return math.sqrt(statistics.fmean(v * v for v in values))
